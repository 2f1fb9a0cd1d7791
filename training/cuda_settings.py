"""GPU defaults that a run would otherwise leave slow, decided in one place (no effect on CPU)."""

from __future__ import annotations

import os

import torch

MAX_DEFAULT_WORKERS = 4


def use_tf32(requested: bool | None, device: torch.device, mixed_precision: str) -> bool:
    """Whether fp32 matmuls and convolutions run as TF32 (10-bit mantissa, about 7x true fp32 on an H100), applied.
    Default: on when computing in fp32; under bf16/fp16 autocast it touches only the few fp32 operations left."""
    enabled = device.type == "cuda" and (requested if requested is not None else mixed_precision == "no")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


def tune_convolutions(device: torch.device, fixed_shapes: bool) -> None:
    # cuDNN's autotuner picks the fastest algorithm once per shape: for images of one size, not text's varying batches
    torch.backends.cudnn.benchmark = device.type == "cuda" and fixed_shapes


def loader_workers(requested: int | None, device: torch.device, local_processes: int) -> int:
    """`--dataloader_num_workers`, or the default: up to 4 per process on GPUs (decoding images in the training
    process starves the GPU), 0 on CPU, where the ranks compute on every core."""
    if requested is not None:
        return requested
    if device.type == "cpu":
        return 0
    cpus = len(os.sched_getaffinity(0))
    if cpus >= (os.cpu_count() or cpus):  # not bound to its own CPUs (SLURM's --cpus-per-task binds): share them
        cpus //= max(local_processes, 1)
    return max(0, min(MAX_DEFAULT_WORKERS, cpus - 1))  # one CPU for the training loop itself
