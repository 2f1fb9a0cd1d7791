"""The optimizer and learning-rate schedule: the same torch objects on every strategy.

`--optim` picks an entry of OPTIMIZERS (transformers' names); a new optimizer is one more
entry. Defaults follow LLM pretraining rather than transformers: AdamW betas (0.9, 0.95).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from accelerate.logging import get_logger
from transformers import get_scheduler
from transformers.trainer_pt_utils import get_parameter_names

logger = get_logger(__name__)

# Hugging Face Trainer's rule: no weight decay on biases and normalisation weights. It goes
# by name, not by tensor shape, because ZeRO-3 builds the model already partitioned (every
# parameter is a flat 1-D shard by the time we see it).
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def _adamw(fused: bool) -> Callable[[list[dict], Any], torch.optim.Optimizer]:
    # fused: one kernel for the whole update (CUDA and CPU), instead of a few per parameter.
    return lambda groups, args: torch.optim.AdamW(
        groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, fused=fused
    )


def _adafactor(groups: list[dict], args) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    # As Trainer's "adafactor": the given learning rate, not Adafactor's own relative step size.
    return Adafactor(groups, lr=args.learning_rate, scale_parameter=False, relative_step=False)


OPTIMIZERS: dict[str, Callable[[list[dict], Any], torch.optim.Optimizer]] = {
    "adamw_torch_fused": _adamw(fused=True),
    "adamw_torch": _adamw(fused=False),
    "sgd": lambda groups, args: torch.optim.SGD(groups, lr=args.learning_rate),
    "adafactor": _adafactor,
}
# Adafactor factors each weight matrix's second moment into row and column statistics. FSDP2
# and ZeRO hand the optimizer shards (ZeRO: flat 1-D partitions), so it would compute
# something else than on one process.
NEEDS_WHOLE_TENSORS = {"adafactor"}


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """`args.optim` over two groups: weights that decay, and biases/norm scales that do not.

    `args` holds the TrainArguments names: optim, learning_rate, weight_decay, adam_beta1,
    adam_beta2, adam_epsilon.
    """
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], NO_DECAY_PATTERNS))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for name, p in named if name in decay], "weight_decay": args.weight_decay},
        {"params": [p for name, p in named if name not in decay], "weight_decay": 0.0},
    ]
    return OPTIMIZERS[args.optim](groups, args)


def check_optimization(args) -> None:
    """Build the optimizer and schedule once on a dummy parameter, so that a setting they reject
    (a beta of 1, a scheduler keyword that does not exist) fails before any model is built."""
    optimizer = build_optimizer(torch.nn.Linear(1, 1), args)
    get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=1, num_training_steps=10,
                  scheduler_specific_kwargs=args.lr_scheduler_kwargs)


def warmup_steps(args, total_steps: int) -> int:
    """`--warmup_ratio` of the total steps when set, else `--warmup_steps`."""
    return math.ceil(args.warmup_ratio * total_steps) if args.warmup_ratio > 0 else args.warmup_steps


def build_scheduler(optimizer: torch.optim.Optimizer, args, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup, then `args.lr_scheduler_type` decay (with `args.lr_scheduler_kwargs`), in optimizer steps.

    train.py steps it once per optimizer step (`step_scheduler_with_optimizer=False`), so
    the schedule does not depend on the number of processes or on accumulation.
    """
    warmup = warmup_steps(args, total_steps)
    if warmup >= total_steps > 1 and args.lr_scheduler_type != "constant":
        logger.warning(
            f"warmup of {warmup} steps covers the whole run of {total_steps}: the learning rate never reaches "
            f"--learning_rate {args.learning_rate}; lower --warmup_steps or use --warmup_ratio",
            main_process_only=True,
        )
    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs)
