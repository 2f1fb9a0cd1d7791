"""The conversion to `SyncBatchNorm` (parts/sync_batchnorm), and where it cannot run."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from training.batchnorm import batch_norm_layers
from training.errors import StrategyError


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
