"""Train a model (a causal LM, or any `--task`) with DDP, FSDP2 or DeepSpeed ZeRO, chosen by config file only.

    accelerate launch train.py                                               # one process, defaults
    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py    # any strategy, same code
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --config recipe.yaml --max_steps 100
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --task image-classification

main() reads as three phases: set up (training/setup.py: the Accelerator, checked to run
what the config file asked for; the model, data, optimizer and a resumed state), train (the
loop below; one optimizer step is training/step.py's `optimizer_step`, one save
training/checkpoints/save.py's `save_checkpoint`), and finish (export, summary). The strategy
never appears here: its few differences live in training/strategy/. The task never does
either: training/tasks.py builds the model and data and turns logits into a loss.
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all, before the libraries load: the parts' first calls, --help (training/prelude.py)
    from training.prelude import before_imports

    before_imports()

import math
import os
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path

import psutil
import torch
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from training.arguments import parse_args
from training.checkpoints.resume import epoch_batches
from training.checkpoints.save import export_final, save_checkpoint
from training.collectives import end_collectives, gather_scalars
from training.console import only_the_training_bar, quiet_third_party_output
from training.dry_run import dry_run
from training.errors import EXIT_UNEXPECTED, Preempted, ending
from training.metrics import MetricsLogger, learning_rates, print_evaluation, print_summary, write_summary
from training.parts import Evaluating, Exporting, Finished, Loop, StepEnd, parts
from training.prelude import after_imports
from training.process_exit import exit_process
from training.setup import Run, set_up
from training.step import NonFiniteGuard, accumulation_windows, optimizer_step
from training.strategy.accelerator import release_model_construction_hooks

logger = get_logger(__name__)


def main() -> None:
    model_args, data_args, args = parse_args()
    quiet_third_party_output()
    if args.dry_run:  # one process, no process group: see training/dry_run.py
        if plan := dry_run(model_args, data_args, args):
            print(plan)
        return
    run = set_up(model_args, data_args, args)
    outcome = train(run)
    finish(run, outcome)


# ---------------------------------------------------------------- train


def train(run: Run) -> dict[str, float]:
    """Optimizer steps until `max_steps`, with logging, evaluation, checkpoints and agreed stops
    between them; returns the last logged loss and evaluation."""
    args, accelerator, state, task = run.args, run.accelerator, run.state, run.task
    metrics = MetricsLogger(accelerator, args.output_dir, fresh=run.first_step == 0)
    if not args.do_train:  # an evaluation only: the model as loaded, at the same evaluation point as training's
        metrics.log(state.completed_steps, **(result := evaluate(run)))
        return result
    at_start = {}  # the step-0 baseline, kept for the summary (e.g. eval_exact_match before and after)
    if state.completed_steps == 0 and args.eval_on_start and args.eval_strategy != "no":
        at_start = evaluate(run)
        metrics.log(0, **at_start)
    interval_loss, interval_steps = torch.zeros((), device=accelerator.device), 0
    nonfinite = NonFiniteGuard(accelerator.device, loss_scaling=accelerator.mixed_precision == "fp16")
    only_the_training_bar()  # one bar, on the main process: steps, ETA, and the last logged loss, lr and tokens/s
    progress = tqdm(total=run.max_steps, initial=state.completed_steps, desc="training", unit="step",
                    disable=not accelerator.is_main_process)
    run.speed.resume()  # the clock runs from here, through loading each batch, to the last step
    train_loss, eval_result = math.nan, {}  # the last logged
    with ExitStack() as guards:  # the parts' (parts/hangs: a collective that timed out, as one error line)
        for guard in parts().around_training(Loop(accelerator, args, lambda: state.completed_steps + 1)):
            guards.enter_context(guard)
        while state.completed_steps < run.max_steps:
            batches = epoch_batches(accelerator, run.train_loader, state, args.gradient_accumulation_steps)
            for window in accumulation_windows(batches, args.gradient_accumulation_steps):
                step_loss, grad_norm, rates = optimizer_step(run, window, nonfinite)
                interval_loss += step_loss
                interval_steps += 1
                step = state.completed_steps
                log_now = step % args.logging_steps == 0 or step == run.max_steps or (args.logging_first_step and step == 1)
                epoch_end = state.steps_in_epoch == run.steps_per_epoch
                eval_now = args.eval_strategy != "no" and (due(args.eval_strategy, args.eval_steps, step, epoch_end)
                                                           or step == run.max_steps)
                save_due = due(args.save_strategy, args.save_steps, step, epoch_end)
                # the device's queued work is this step's: waited for inside its clock before logging, evaluating or saving
                run.speed.end_step(sum(task.count_units(batch) for batch in window), synchronize=log_now or eval_now or save_due)
                progress.update(1)
                # a part may ask every rank to save and stop after this step (parts/preemption: a signal)
                stop = parts().stop_requested(StepEnd(args, step, log_now or eval_now or save_due or epoch_end))
                save_now = save_due or bool(stop)
                if log_now or eval_now or save_now:
                    # One collective and one wait for the device: the non-finite check, and the logged figures.
                    logged = {"loss": interval_loss, "grad_norm": grad_norm} | run.speed.interval() if log_now else {}
                    ranks = gather_scalars(accelerator, nonfinite.local() | logged)
                    nonfinite.check(ranks)  # before anything is logged, saved or exported
                if log_now:
                    train_loss = float(ranks["loss"].sum()) / interval_steps
                    interval_loss.zero_()
                    interval_steps = 0
                    speed_now = run.speed.report_interval(ranks)
                    metrics.log(step, loss=train_loss, **learning_rates(rates, run.torch_optimizer.param_groups),
                                grad_norm=float(ranks["grad_norm"].max()), **speed_now, **nonfinite.logged(ranks))
                    progress.set_postfix({"loss": f"{train_loss:.3f}", "lr": f"{rates[0]:.2e}",
                                          f"{task.unit}_per_s": f"{speed_now[f'{task.unit}_per_sec']:,.0f}"})
                if eval_now:
                    eval_result = evaluate(run)
                    metrics.log(step, **eval_result)
                    if accelerator.is_main_process:
                        progress.write(f"step {step}: eval_loss {eval_result['eval_loss']:.4f}")
                if save_now:
                    saved = save_checkpoint(accelerator, run.runner, run.model, run.optimizer, args.output_dir, state,
                                            args.save_total_limit)
                    if accelerator.is_main_process:
                        progress.write(f"step {step}: saved {saved}")
                if log_now or eval_now or save_now:
                    run.speed.resume()  # logging, evaluation and saving are not training time
                if step >= run.max_steps:
                    break
                if stop:
                    end_collectives(accelerator)  # flush the trackers
                    if accelerator.is_main_process:
                        parts().run_ended(Finished(args, run.model_args, run.title))  # the parts' (report.png)
                    raise Preempted(f"{stop[0]} received: stopped after step {step} and saved {saved}; "
                                    "continue with --resume_from_checkpoint latest")
            else:  # the epoch ran out before max_steps
                state.epoch, state.steps_in_epoch = state.epoch + 1, 0
    progress.close()
    return {"train_loss": train_loss, **eval_result, **{f"{key}_at_start": value for key, value in at_start.items()}}



def evaluate(run: Run) -> dict[str, float]:
    """The task's metrics over the validation set on the weights as trained, then the parts' other passes, each
    within its part's context (parts/ema: the average's weights swapped in, `eval_ema_loss`, ...)."""
    result = run.runner.evaluate(run.model, run.eval_loader, run.task, run.ranks_per_batch)
    passes = parts().around_evaluation(Evaluating(run.accelerator, run.args, run.model, run.state.completed_steps))
    for prefix, weights in passes.items():
        with weights:
            other = run.runner.evaluate(run.model, run.eval_loader, run.task, run.ranks_per_batch)
        # eval_loss -> eval_ema_loss, perplexity -> eval_ema_perplexity
        result |= {f"{prefix}_{key.removeprefix('eval_')}": value for key, value in other.items()}
    return result


def due(strategy: str, every: int, step: int, epoch_end: bool) -> bool:
    """Whether an --eval_strategy/--save_strategy interval ("steps", "epoch" or "no") falls on this step."""
    return {"steps": step % every == 0, "epoch": epoch_end, "no": False}[strategy]


# ---------------------------------------------------------------- finish


def finish(run: Run, outcome: dict[str, float]) -> None:
    """Export the model, gather the run's figures from every rank, close the process group, and
    (main process) write summary.json and the report, and print the summary."""
    accelerator, state, args = run.accelerator, run.state, run.args
    final_dir = None
    if args.do_train:  # within the parts' contexts (parts/ema: the average's weights, on request)
        with ExitStack() as weights:
            for context in parts().around_export(Exporting(accelerator, args, run.model, Path(args.output_dir) / "final")):
                weights.enter_context(context)
            final_dir = export_final(accelerator, run.runner, run.model, run.task, args.output_dir)
    steps_run = state.completed_steps - run.first_step
    trained = {
        **run.speed.report(gather_scalars(accelerator, run.speed.whole_run())),
        **run.speed.steady_state(),  # the whole-run figures above keep the intervals' warm-up
        **({f"flops_per_{run.task.unit.removesuffix('s')}": run.task.flops_per_unit} if run.task.flops_per_unit else {}),
    } if args.do_train else {}
    summary = {  # gathered from every rank: before end_training closes the process group
        "strategy": run.strategy.value,
        "processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "parameters": run.num_parameters,
        "task": run.task.name,
        "model": run.model_name,
        "steps": steps_run,
        "total_steps": state.completed_steps,
        "per_device_train_batch_size": run.args.per_device_train_batch_size,  # the micro-batch that ran
        "gradient_accumulation_steps": run.args.gradient_accumulation_steps,
        "wall_time_s": time.time() - psutil.Process().create_time(),
        **trained,
        **parts().summary(steps_run),  # the parts' (a compression hook's bytes, the model state measured)
        **outcome,
    }
    end_collectives(accelerator)
    release_model_construction_hooks()
    if accelerator.is_main_process:
        write_summary(run.args.output_dir, summary)
        finished = Finished(run.args, run.model_args, run.title, final_dir, run.task.processor)
        parts().run_ended(finished)  # the parts' (report.png, a merged adapter)
        if args.do_train:
            print_summary(summary, final_dir, run.task)
        else:
            print_evaluation(summary, run.model_name)


def run() -> int:
    """`main()`, with each documented failure turned into one error line and its exit code, and any other
    exception into its traceback and exit 1: every way out ends in `exit_process`."""
    after_imports()
    try:
        main()
    except Exception as error:
        if (end := ending(error)) is None:  # a bug, here or in a library: its traceback, then the same clean exit
            traceback.print_exc()
            return EXIT_UNEXPECTED
        # once per machine, unless the error is each rank's own (another machine may differ: a file missing there)
        if end.every_rank or os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"\n{end.prefix}: {end}", file=sys.stderr)  # on its own line, even after a progress bar
        return end.exit_code
    return 0


if __name__ == "__main__":
    exit_process(run())  # not sys.exit: see training/process_exit.py (gloo can abort a finished rank at teardown)
