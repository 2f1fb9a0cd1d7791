"""GPU defaults that a run would otherwise leave slow, and the GPUs a launch leaves idle (no effect on CPU)."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator

MAX_DEFAULT_WORKERS = 4


def use_tf32(requested: bool | None, device: torch.device, mixed_precision: str) -> bool:
    """Whether fp32 matmuls and convolutions run as TF32 (10-bit mantissa, about 7x true fp32 on an H100), applied.
    Default: on when computing in fp32; under bf16/fp16 autocast it touches only the few fp32 operations left."""
    enabled = device.type == "cuda" and (requested if requested is not None else mixed_precision == "no")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


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


def idle_gpu_warning(accelerator: Accelerator, owns_every_gpu: bool) -> str | None:
    """A warning when this machine has more GPUs than processes (every config says `num_processes: 2`: 6 of an 8-GPU
    node idle unless the launch says otherwise); `owns_every_gpu`: one process spreads the model over all of them."""
    if accelerator.device.type == "cpu" or owns_every_gpu:
        return None
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return idle_gpus(local_processes, torch.accelerator.device_count(), accelerator.num_processes // local_processes)


def idle_gpus(local_processes: int, local_gpus: int, machines: int) -> str | None:
    """`idle_gpu_warning`'s decision, from the counts."""
    if local_processes >= local_gpus:
        return None
    return (f"this machine has {local_gpus} GPUs but {local_processes} process(es) run on it: {local_gpus - local_processes} "
            f"sit idle. Launch with `accelerate launch --num_processes {local_gpus * machines} ...` (the total over "
            "all machines)")
