"""GPU defaults that a run would otherwise leave slow, decided in one place (no effect on CPU).

- TF32 (`--tf32`, transformers' name): fp32 matmuls and convolutions on tensor cores, about 7x
  faster than true fp32 on an H100 with a 10-bit mantissa. On by default when the run
  computes in fp32 (no `--mixed_precision`); under bf16/fp16 autocast it only touches the
  few fp32 operations left. MFU then counts against the TF32 peak (training/performance.py).
- cuDNN's autotuner for fixed input shapes (images of one size): it picks the fastest
  convolution algorithm once per shape. Off for text, whose batch shapes vary.
- DataLoader workers: decoding and augmenting images in the training process starves the
  GPU; up to 4 workers per process, within the CPUs this process may use.
- Liger's kernels (`--use_liger_kernel`, opt-in, an optional install): fused RMSNorm and SwiGLU
  in Triton for the model's own modules. Without torch.compile these elementwise steps
  are most of a small model's GPU time. Its fused linear cross-entropy is left off: the loss
  is train.py's (training/loss.py), which `--torch_compile` fuses instead.
"""

from __future__ import annotations

import os
import sys

import torch

from training.errors import ArgumentError

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


def apply_liger_kernel(model: torch.nn.Module, device: torch.device) -> None:
    """--use_liger_kernel: Liger's kernels patched into `model`'s modules, or one line saying why not."""
    if device.type != "cuda":
        raise ArgumentError(f"--use_liger_kernel runs Triton kernels on NVIDIA GPUs; this run is on {device.type}: "
                            "drop the flag")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    except ImportError as missing:
        raise ArgumentError(f"--use_liger_kernel needs liger-kernel ({missing}): pip install liger-kernel==0.8.5, "
                            "or drop the flag") from None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ArgumentError(f"--use_liger_kernel: liger-kernel has no kernels for model type {model_type!r}: drop the flag")
    # Liger also swaps its classes and functions into the model's modeling module, for every model this
    # process builds later: the CPU sample of final/ among them, where Triton cannot run. So the module is put
    # back, and RoPE, a module function rather than a module of this model, stays unfused.
    modeling = sys.modules[type(model).__module__]
    before = dict(vars(modeling))
    _apply_liger_kernel_to_instance(model=model, rope=False, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)  # each family takes the options it has
    for name, value in before.items():
        setattr(modeling, name, value)
