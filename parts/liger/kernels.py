"""Liger's kernels patched into a model's own modules (parts/liger): the part's one hook, and its refusals.

Liger's fused linear cross-entropy joins through another part, `--fused_linear_cross_entropy` (parts/fused_loss),
which computes the task's loss with the output layer: here it would replace the model's forward.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from training.errors import ArgumentError


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
    # Liger swaps its classes and functions into the model's modeling module, for every model this process builds
    # later: the CPU sample of final/ among them, where Triton cannot run. So the module is put back, and RoPE (a
    # module function, not a module of this model) runs Liger's kernel on GPU tensors only.
    modeling = sys.modules[type(model).__module__]
    before = dict(vars(modeling))
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)  # each family takes the options it has
    fused_rope = vars(modeling).get(ROPE)
    for name, value in before.items():
        setattr(modeling, name, value)
    if ROPE in before and fused_rope is not before[ROPE]:
        setattr(modeling, ROPE, on_gpu_tensors(fused_rope, before[ROPE]))


ROPE = "apply_rotary_pos_emb"  # transformers' RoPE function, in each model family's modeling module


def on_gpu_tensors(kernel: Callable, original: Callable) -> Callable:
    """`kernel` where its first argument is a CUDA tensor, `original` elsewhere (CPU tensors: Triton cannot run)."""

    @functools.wraps(original)
    def dispatch(tensor: torch.Tensor, *args, **kwargs):
        return (kernel if tensor.is_cuda else original)(tensor, *args, **kwargs)

    return dispatch
