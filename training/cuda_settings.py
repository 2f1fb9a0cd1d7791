"""GPU defaults that a run would otherwise leave slow, decided in one place (no effect on CPU).

- TF32 (`--tf32`, transformers' name): fp32 matmuls and convolutions on tensor cores, about 7x
  faster than true fp32 on an H100 with a 10-bit mantissa. On by default when the run
  computes in fp32 (no `--mixed_precision`); under bf16/fp16 autocast it only touches the
  few fp32 operations left. MFU then counts against the TF32 peak (training/performance.py).
- cuDNN's autotuner for fixed input shapes (images of one size): it picks the fastest
  convolution algorithm once per shape. Off for text, whose batch shapes vary.
- DataLoader workers: decoding and augmenting images in the training process starves the
  GPU; up to 4 workers per process, within the CPUs this process may use.
"""

from __future__ import annotations

import os

import torch

MAX_DEFAULT_WORKERS = 4


def use_tf32(requested: bool | None, device: torch.device, mixed_precision: str) -> bool:
    """Whether fp32 matmuls run as TF32 in this run; applied to torch's settings."""
    enabled = device.type == "cuda" and (requested if requested is not None else mixed_precision == "no")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


def tune_convolutions(device: torch.device, fixed_shapes: bool) -> None:
    torch.backends.cudnn.benchmark = device.type == "cuda" and fixed_shapes


def loader_workers(requested: int | None, device: torch.device, local_processes: int) -> int:
    """`--dataloader_num_workers`, or the default: 0 on CPU, where the ranks compute on every core."""
    if requested is not None:
        return requested
    if device.type == "cpu":
        return 0
    cpus = len(os.sched_getaffinity(0))
    if cpus >= (os.cpu_count() or cpus):  # not bound to its own CPUs (SLURM's --cpus-per-task binds): share them
        cpus //= max(local_processes, 1)
    return max(0, min(MAX_DEFAULT_WORKERS, cpus - 1))  # one CPU for the training loop itself

