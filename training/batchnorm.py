"""Batch normalisation under data parallelism: one set of running statistics on every rank.
(Statistics over every process's micro-batch in training: the part parts/sync_batchnorm.)

Running statistics (what evaluation normalises with) are updated by each process from its
own batches, so the ranks drift apart. DDP would copy rank 0's over everyone else's before
every forward; FSDP2 and DeepSpeed do nothing. So that every strategy behaves the same, DDP's
copy is turned off (training/strategy/accelerator.py) and every strategy averages the running
statistics over the ranks before each evaluation, checkpoint and export: every rank then
evaluates the same model, and the export holds what all ranks saw.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.nn.modules.batchnorm import _BatchNorm


def batch_norm_layers(model: torch.nn.Module) -> list[_BatchNorm]:
    return [module for module in model.modules() if isinstance(module, _BatchNorm)]


def running_statistics(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every BatchNorm layer's running mean and variance (the buffers evaluation normalises with)."""
    return [buffer for layer in batch_norm_layers(model) if layer.track_running_stats
            for buffer in (layer.running_mean, layer.running_var)]


@torch.no_grad()
def average_running_statistics(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """Replace every rank's BatchNorm running mean and variance by their mean over the ranks (a collective)."""
    stats = running_statistics(model)
    if not stats or accelerator.num_processes == 1:
        return
    flat = torch.cat([buffer.float().flatten() for buffer in stats])
    if (replicas := getattr(model, "replica_group", None)) is not None:  # pipeline stages: over their own replicas
        torch.distributed.all_reduce(flat, group=replicas)
        averaged = flat / torch.distributed.get_world_size(replicas)
    else:
        averaged = accelerator.reduce(flat, "mean")
    for buffer, values in zip(stats, averaged.split([buffer.numel() for buffer in stats])):
        buffer.copy_(values.view_as(buffer))
