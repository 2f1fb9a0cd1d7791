"""Batch normalisation under data parallelism: `--sync_batchnorm`, and one set of running statistics.

Why per-device batches matter: BatchNorm normalises each layer with the mean and variance
of the batch it sees. Under data parallelism each process sees only its per-device batch,
so with a few examples per device those statistics are noisy (with one they are
degenerate) and training suffers, however large the global batch. `SyncBatchNorm` computes
them over the micro-batches of all processes together, at the cost of collectives in
every BatchNorm layer, forward and backward. torch implements it for GPUs only.

Running statistics (what evaluation normalises with) are updated by each process from its
own batches, so the ranks drift apart. DDP would copy rank 0's over everyone else's before
every forward; FSDP2 and DeepSpeed do nothing. So that every strategy behaves the same, DDP's
copy is turned off (training/accelerator.py) and every strategy averages the running
statistics over the ranks before each evaluation, checkpoint and export: every rank then
evaluates the same model, and the export holds what all ranks saw.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.nn.modules.batchnorm import _BatchNorm

from training.errors import StrategyError


def batch_norm_layers(model: torch.nn.Module) -> list[_BatchNorm]:
    return [module for module in model.modules() if isinstance(module, _BatchNorm)]


def running_statistics(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every BatchNorm layer's running mean and variance (the buffers evaluation normalises with)."""
    return [buffer for layer in batch_norm_layers(model) if layer.track_running_stats
            for buffer in (layer.running_mean, layer.running_var)]


def convert_sync_batchnorm(model: torch.nn.Module, accelerator: Accelerator) -> tuple[torch.nn.Module, str]:
    """The model with `SyncBatchNorm` layers (before `prepare`), and a line for the logs saying what happened."""
    layers = len(batch_norm_layers(model))
    if layers == 0:
        return model, "--sync_batchnorm: the model has no BatchNorm layers; nothing to synchronise"
    if accelerator.num_processes == 1:
        return model, "--sync_batchnorm: one process sees the whole batch already; BatchNorm left as it is"
    if accelerator.device.type == "cpu":
        raise StrategyError(
            "--sync_batchnorm needs GPUs: torch has no CPU kernels for SyncBatchNorm; drop the flag on CPU "
            "(running statistics are still averaged across ranks before evaluation)"
        )
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model), f"--sync_batchnorm: {layers} BatchNorm layers synchronised"


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
