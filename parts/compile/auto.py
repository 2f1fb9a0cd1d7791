"""Whether the training step compiles when --torch_compile is left unset: where compiling pays back, on the paths the
tests hold compiled to eager. Measured on this machine (docs/compile.md#compiled-by-default): compiling the step costs
about 23 s the first time and about 4 s once torch's compile cache holds its graphs, and saves 10 to 17% of each
step, so at the default job's size it pays back within about 1,000 steps even the first time (160 once cached), at
llama-tiny's within about 1,200 once cached. A run planned shorter stays eager; `--torch_compile true` or `false`
decides alone."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from training.flags import every_flag
from training.parts import Training
from training.strategy import Strategy

PAYS_BACK_AFTER_STEPS = 1000
# parts' flags that keep an unset --torch_compile eager, at the value that is off: paths not proven compiled (and the
# micro-batch search, whose every tried size would be another compilation)
EAGER_UNLESS_ASKED = {"use_peft": False, "pipeline_parallel_size": 1, "ddp_comm_hook": None,
                      "auto_find_batch_size": False}


def compiles(objective: Callable, training: Training) -> tuple[bool, str]:
    """Whether the training step's objective compiles, and why (for the start-up log)."""
    from training.step import objective_sums
    from training.tasks import next_token_loss_as_is

    asked = training.args.parts.compile.torch_compile
    if asked is not None:
        return asked, f"--torch_compile {str(asked).lower()}"
    flags = every_flag(training.args)
    reasons = {f"--{name} {flags[name]}": flags[name] != off for name, off in EAGER_UNLESS_ASKED.items() if name in flags}
    reasons |= {
        "--do_train false: nothing trains": not training.args.do_train,
        "--gradient_checkpointing": getattr(training.accelerator.unwrap_model(training.model),
                                            "is_activation_checkpointing", False),
        f"{training.strategy.value}: compiled by default on one process or DDP only":
            training.strategy not in (Strategy.SINGLE, Strategy.DDP),
        f"task {training.task.name} has its own forward or loss": not next_token_loss_as_is(training.task),
        "--packing false: batches of many shapes": not getattr(getattr(training.task, "data_args", None), "packing", True),
        "a part computes the loss": not (isinstance(objective, partial) and objective.func is objective_sums),
        f"{training.max_steps} steps, under the {PAYS_BACK_AFTER_STEPS:,} that pay back compiling":
            training.max_steps < PAYS_BACK_AFTER_STEPS,
    }
    if why := [reason for reason, holds in reasons.items() if holds]:
        return False, f"--torch_compile unset: {why[0]}"
    return True, f"--torch_compile unset: {training.max_steps} steps, at least the {PAYS_BACK_AFTER_STEPS:,} that pay back compiling"
