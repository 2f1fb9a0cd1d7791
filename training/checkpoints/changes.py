"""What a resume may change of the run it continues (docs/train-py.md "Resume"). A checkpoint records every flag's
value; a flag this run gives otherwise is honoured from the resumed step and logged once (`learning_rate 0.001 ->
0.0005 from step 4`), or refused in one line where the state cannot follow it. The model, its layout, the global
batch and --optim are resume.py's own checks. Honouring needs one act: accelerate's `load_state` puts the checkpoint's
`base_lrs` into the scheduler, and this run's are put back (`this_runs_rates`, `restore_rates`); every other setting
is read from this run's flags as it runs (the optimizer's groups keep this run's weight decay, betas and epsilon)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accelerate.logging import get_logger

from training.checkpoints.files import TrainerState
from training.errors import ResumeError
from training.parts import installed_parts

logger = get_logger(__name__)

# where and how this launch runs and reports, not what it computes: never compared
LAUNCH = frozenset({"output_dir", "overwrite_output_dir", "resume_from_checkpoint", "resume_unchecked",
                    "allow_config_changes", "run_name", "report_to", "dry_run", "do_train"})

# the core's flags a resume cannot change, and why (a part declares its own: `Part.fixed_on_resume`)
REFUSED = {
    "seed": "the data order of the epoch it resumes in and the random generators it restores follow the seed: the "
            "rest of the epoch would see some examples twice and others never",
}

# schedules that keep state of their own (the best loss seen, a patience count), which no other schedule continues
STATEFUL_SCHEDULES = frozenset({"reduce_lr_on_plateau", "greedy"})
SCHEDULE_SETTINGS = ("lr_scheduler_type", "learning_rate", "lr_scheduler_kwargs")  # what such a schedule keeps


def recorded_flags(values: dict[str, Any]) -> dict[str, Any]:
    """Every flag's value as a checkpoint records it (as JSON holds it: the same in every process)."""
    return json.loads(json.dumps(values, default=str))


def refused_on_resume() -> dict[str, str]:
    """The flags a resume cannot change, the core's and the installed parts' (named), with why."""
    return REFUSED | {flag: f"parts/{part.name}: {why}" for part in installed_parts()
                      for flag, why in part.fixed_on_resume.items()}


def check_changes(path: Path, saved: TrainerState, this_run: TrainerState) -> list[str]:
    """Every rank, before anything loads: refuse what the state cannot follow (another number of optimizer groups, a
    stateful schedule's settings changed, a flag of `refused_on_resume`); the line of each other flag changed, which
    `log_changes` logs once the resume has loaded."""
    if saved.optimizer_groups and saved.optimizer_groups != this_run.optimizer_groups:
        raise ResumeError(f"{path} holds an optimizer of {saved.optimizer_groups} parameter groups and this run's has "
                          f"{this_run.optimizer_groups} (the groups a part's flags or the model's trainable parameters "
                          "make); resume with the flags it was trained with, or start a new run from that run's final/ "
                          "with --model_name_or_path (the optimizer state is not carried over)")
    before, after = saved.flags, this_run.flags
    changed = {flag: (before[flag], value) for flag, value in after.items()
               if flag in before and flag not in LAUNCH and before[flag] != value}
    stateful = sorted(STATEFUL_SCHEDULES & {before.get("lr_scheduler_type"), after.get("lr_scheduler_type")})
    if stateful and (flag := next((name for name in SCHEDULE_SETTINGS if name in changed), None)):
        raise _refused(path, flag, changed[flag], f"{stateful[0]} keeps the rate and its settings in state of its own, "
                                                  "which no other setting continues")
    refused = refused_on_resume()
    for flag, values in changed.items():
        if flag in refused:
            raise _refused(path, flag, values, refused[flag])
    return [f"{flag} {_shown(old)} -> {_shown(new)} from step {saved.completed_steps} (changed on resume)"
            for flag, (old, new) in changed.items()]


def log_changes(lines: list[str]) -> None:
    """`check_changes`' lines, once the resume has loaded (a resume refused later changed nothing)."""
    for line in lines:
        logger.warning(line, main_process_only=True)


def _refused(path: Path, flag: str, values: tuple[Any, Any], why: str) -> ResumeError:
    old, new = (_shown(value) for value in values)
    return ResumeError(f"{path} was trained with --{flag} {old} and this run gives --{flag} {new}, which a resume "
                       f"cannot change ({why}); resume with --{flag} {old}, or start a new run from that run's final/ "
                       "with --model_name_or_path")


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def this_runs_rates(scheduler) -> list[float] | None:
    """The learning rates this run's schedule starts from (None: a schedule without them)."""
    inner = getattr(scheduler, "scheduler", scheduler)  # (accelerate's wrapper)
    return list(inner.base_lrs) if hasattr(inner, "base_lrs") else None


def restore_rates(scheduler, rates: list[float] | None) -> None:
    """This run's rates back in the schedule, after accelerate's `load_state` put the checkpoint's there."""
    if rates is not None:
        getattr(scheduler, "scheduler", scheduler).base_lrs = rates
