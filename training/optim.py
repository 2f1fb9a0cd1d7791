"""The optimizer and learning-rate schedule, the same on every strategy (ZeRO optimizer offload: DeepSpeedCPUAdam, built
on first use in about a minute, then cached). Heavy imports stay inside functions, so `--help` stays instant."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from training.errors import ArgumentError, StrategyError

if TYPE_CHECKING:
    import torch

# Trainer's rule, by name, not by shape: ZeRO-3 builds the model already partitioned (every parameter a flat 1-D shard).
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


@dataclass(frozen=True)
class OptimizerChoice:
    class_path: str  # "module.Class"
    settings: Callable[[Any], dict[str, Any]]  # args -> keyword arguments
    needs_whole_tensors: bool = False  # factors each matrix's second moment by rows and columns; FSDP2/ZeRO shard them
    offloaded: OptimizerChoice | None = None  # what runs instead under ZeRO optimizer offload

    @property
    def class_name(self) -> str:
        return self.class_path.rsplit(".", 1)[1]

    def build(self, groups: list[dict], args) -> torch.optim.Optimizer:
        module, name = self.class_path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)(groups, **self.settings(args))


def _adamw(args) -> dict[str, Any]:
    return {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}


DEEPSPEED_CPU_ADAMW = OptimizerChoice("deepspeed.ops.adam.DeepSpeedCPUAdam", lambda args: _adamw(args) | {"adamw_mode": True})

OPTIMIZERS: dict[str, OptimizerChoice] = {
    "adamw_torch_fused": OptimizerChoice("torch.optim.AdamW", lambda args: _adamw(args) | {"fused": True},
                                         offloaded=DEEPSPEED_CPU_ADAMW),  # fused: one kernel, not a few per parameter
    "adamw_torch": OptimizerChoice("torch.optim.AdamW", _adamw, offloaded=DEEPSPEED_CPU_ADAMW),
    "sgd": OptimizerChoice("torch.optim.SGD", lambda args: {"lr": args.learning_rate}),
    "adafactor": OptimizerChoice("transformers.optimization.Adafactor",
                                 lambda args: {"lr": args.learning_rate, "scale_parameter": False, "relative_step": False},
                                 needs_whole_tensors=True),  # as Trainer's: the given lr, not a relative step size
}


def optimizer_for(name: str, offloaded: bool = False) -> OptimizerChoice:
    """`--optim`'s entry, or what runs instead when ZeRO steps the optimizer on the CPU."""
    return (offloaded and OPTIMIZERS[name].offloaded) or OPTIMIZERS[name]


def parameter_groups(model: torch.nn.Module, args) -> list[dict]:
    """The trainable parameters in two groups: weights that decay, and biases/norm scales that do not."""
    import torch
    from transformers.trainer_pt_utils import get_parameter_names

    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], NO_DECAY_PATTERNS))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for name, p in named if (name in decay) == decays],
             "weight_decay": args.weight_decay if decays else 0.0} for decays in (True, False)]


def build_optimizer(model: torch.nn.Module, args, offloaded: bool = False) -> torch.optim.Optimizer:
    """`args.optim` over the core's `parameter_groups` as the parts regroup them (`Part.optimizer_groups`);
    `offloaded`: ZeRO steps on the CPU."""
    from training.parts import Grouping, parts

    return optimizer_over(parts().optimizer_groups(parameter_groups(model, args), Grouping(model, args)), args, offloaded)


def optimizer_over(groups: list[dict], args, offloaded: bool = False) -> torch.optim.Optimizer:
    """`args.optim` over `groups`."""
    # one group per dtype: ZeRO flattens a group into one buffer, of one dtype (a float64 parameter among float32 ones
    # made them all float64). An adapter has no trainable biases/norms: DeepSpeed drops an empty group, then the
    # scheduler steps one too many
    groups = [group | {"params": [p for p in group["params"] if p.dtype == dtype]} for group in groups
              for dtype in sorted({p.dtype for p in group["params"]}, key=str)]
    choice = optimizer_for(args.optim, offloaded)
    if choice is DEEPSPEED_CPU_ADAMW:
        prepare_cpu_adam(args)
    try:
        return choice.build(groups, args)
    except RuntimeError as error:
        if choice is not DEEPSPEED_CPU_ADAMW:
            raise
        cause = str(error.__cause__ or error).strip().splitlines()[-1]
        raise StrategyError(
            f"DeepSpeed's CPU Adam, which steps the optimizer under ZeRO optimizer offload, failed to build ({cause}); "
            "it compiles on first use: install a C++ compiler and ninja (`pip install ninja`), or use a config "
            "without offload_optimizer (accelerate_configs/deepspeed_zero3.yaml)") from error


def prepare_cpu_adam(args) -> None:
    """Before DeepSpeed's CPU Adam builds or loads: the parts' start-up settings (parts/fast_start) key the build.
    `args`: the run's TrainArguments."""
    import os

    from training.parts import Launch, parts
    from training.strategy import Strategy

    parts().at_start(Launch(args, Strategy.DEEPSPEED, int(os.environ.get("WORLD_SIZE", "1")), on_cpu=True))


def check_optimization(args) -> None:
    """Build both on a dummy parameter: a setting they reject (a beta of 1, a bad keyword) fails before the model."""
    import torch
    from transformers import get_scheduler

    optimizer = optimizer_over(parameter_groups(torch.nn.Linear(1, 1), args), args)
    get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=1, num_training_steps=10,
                  scheduler_specific_kwargs=args.lr_scheduler_kwargs)


def global_batch_size(args, data_parallel: int) -> int:
    return args.per_device_train_batch_size * data_parallel * args.gradient_accumulation_steps


def run_length(train_examples: int, eval_examples: int, global_batch: int, args) -> tuple[int, int]:
    """Steps per epoch and in the run; an epoch's last partial global batch is left out (it would weigh less)."""
    steps_per_epoch = train_examples // global_batch
    if steps_per_epoch == 0 or eval_examples == 0:
        raise ArgumentError(
            f"{train_examples} training and {eval_examples} validation examples: need at least one global batch of "
            f"{global_batch} and one validation example; use more data or smaller batches")
    return steps_per_epoch, args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)


def warmup_steps(args, total_steps: int) -> int:
    """Rounded down: transformers rounds up, so a 1-step run would only warm up, at rate 0."""
    return args.warmup_steps if args.warmup_steps is not None else math.floor(args.warmup_ratio * total_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, args, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """In optimizer steps, so the schedule depends on neither the number of processes nor accumulation: a part's own
    (`Part.lr_multiplier`) after the linear warmup, or --lr_scheduler_type's."""
    from accelerate.logging import get_logger
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import get_scheduler

    from training.parts import Schedule, parts

    warmup = warmup_steps(args, total_steps)
    if multiplier := parts().lr_multiplier(Schedule(args, total_steps, warmup)):
        if {"lr_scheduler_type", "lr_scheduler_kwargs"} & getattr(args, "given", frozenset()):
            raise ArgumentError("--lr_scheduler_type and --lr_scheduler_kwargs with a part's own schedule "
                                "(Part.lr_multiplier) are not supported: the part's schedule would replace them; drop them")
        scheduler = LambdaLR(optimizer, partial(warmed_up, multiplier, warmup))
    else:
        scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                  num_training_steps=total_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    if getattr(args, "do_train", True) and (warning := idle_steps_warning(scheduler, total_steps, warmup)):
        get_logger(__name__).warning(warning, main_process_only=True)
    return scheduler


def warmed_up(multiplier: Callable[[int], float], warmup: int, step: int) -> float:
    """Linear warmup from 0 as transformers' schedules warm up, then `multiplier`."""
    return step / max(1, warmup) if step < warmup else multiplier(step)


def idle_steps_warning(scheduler: torch.optim.lr_scheduler.LRScheduler, total_steps: int, warmup: int) -> str | None:
    """Warns of steps at rate 0 (a 1-step run in a 30-step warmup saved only its init); a warmup's step 1 is exempt."""
    if not hasattr(scheduler, "lr_lambdas"):  # reduce_lr_on_plateau, greedy: no rate known in advance
        return None
    factors = [scheduler.lr_lambdas[0](step) for step in range(total_steps)]  # the rate of step k + 1, relative
    idle = [step + 1 for step, factor in enumerate(factors) if factor == 0 and not (step == 0 < warmup < total_steps)]
    if len(idle) == total_steps:
        return (f"every one of the {total_steps} steps trains at learning rate 0 (a warmup of {warmup}): nothing is "
                "learned; lower --warmup_steps/--warmup_ratio or raise --max_steps")
    if warmup >= total_steps:
        return (f"warmup of {warmup} steps covers the whole run of {total_steps}: step 1 trains at learning rate 0 "
                "and the rate never reaches --learning_rate; lower --warmup_steps or --warmup_ratio")
    if idle:
        return f"steps {idle[:5]}{'...' if len(idle) > 5 else ''} train at learning rate 0: check the schedule's flags"
    return None
