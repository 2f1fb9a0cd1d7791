"""Launched by tests/test_resume_matrix.py under one accelerate config: one key of the resume matrix.

    accelerate launch --config_file <config> tests/probes/resume_probe.py <key.json>

key.json: `flags` (train.py's), `origin` (an output_dir, or null), `resume` ({case name: a checkpoint another key
saved}), `cases` and `scratch` (directories). With train.py's own functions, in one process group:
1. with an `origin`: train from scratch into it as train.py does (`set_up`, `train`), saving every step, and export
   `final/` (`export_final`): the run that goes on, which other keys resume;
2. for each checkpoint of `resume`: restore it as a resume does (`resume`) and save it again at once
   (`save_checkpoint`, in `cases/<name>`), then take the next optimizer step (`optimizer_step`) and save that too, with
   the step's loss in `cases/<name>/loss.json`.
"""

import copy
import json
import sys
from pathlib import Path

from train import train
from training.arguments import parse_args
from training.checkpoints.resume import epoch_batches, resume
from training.checkpoints.save import export_final, save_checkpoint
from training.collectives import end_collectives
from training.prelude import after_imports
from training.process_exit import exit_process
from training.setup import set_up
from training.step import NonFiniteGuard, accumulation_windows, optimizer_step

after_imports()
key = json.loads(Path(sys.argv[1]).read_text())
model_args, data_args, args = parse_args([*key["flags"], "--output_dir", key["origin"] or key["scratch"]])
run = set_up(model_args, data_args, args)
fresh = copy.copy(run.state)  # this run's settings, which a resumed state takes on
accelerator = run.accelerator
if key["origin"]:
    train(run)
    export_final(accelerator, run.runner, run.model, run.task, key["origin"])
for name, checkpoint in key["resume"].items():
    output_dir = str(Path(key["cases"]) / name)
    run.state = state = resume(accelerator, Path(checkpoint), fresh, run.max_steps, args.seed, run.runner, run.model,
                               run.optimizer, run.scheduler, output_dir)
    save_checkpoint(accelerator, run.runner, run.model, run.optimizer, output_dir, state, None)
    batches = epoch_batches(accelerator, run.train_loader, state, args.gradient_accumulation_steps)
    loss, _, _ = optimizer_step(run, next(accumulation_windows(batches, args.gradient_accumulation_steps)),
                                NonFiniteGuard(accelerator.device))
    loss = float(accelerator.reduce(loss, "sum"))  # the step's loss, as train.py logs it: the ranks' shares summed
    save_checkpoint(accelerator, run.runner, run.model, run.optimizer, output_dir, state, None)
    if accelerator.is_main_process:
        (Path(output_dir) / "loss.json").write_text(json.dumps(loss))
end_collectives(accelerator)
exit_process(0)  # as train.py ends (training/process_exit.py)
