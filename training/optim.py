"""The optimizer and learning-rate schedule: the same torch objects on every strategy."""

from __future__ import annotations

import torch
from transformers import get_scheduler
from transformers.trainer_pt_utils import get_parameter_names

# Hugging Face Trainer's rule: no weight decay on biases and normalisation weights. It goes
# by name, not by tensor shape, because ZeRO-3 builds the model already partitioned (every
# parameter is a flat 1-D shard by the time we see it).
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def build_optimizer(model: torch.nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with two groups: weights that decay, and biases/norm scales that do not."""
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], NO_DECAY_PATTERNS))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for name, p in named if name in decay], "weight_decay": weight_decay},
        {"params": [p for name, p in named if name not in decay], "weight_decay": 0.0},
    ]
    # fused: one kernel for the whole update (CUDA and CPU), instead of a few per parameter.
    return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), fused=True)


def build_scheduler(
    optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup, then `name` decay, counted in optimizer steps.

    train.py steps it once per optimizer step (`step_scheduler_with_optimizer=False`), so
    the schedule does not depend on the number of processes or on accumulation.
    """
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
