"""The parameters swapped for their bf16 casts while the objective runs, as `torch.func.functional_call` swaps them.
(functional_call itself calls the module it is given: here the call goes through DDP to the module inside it.)"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.stateless import _reparametrize_module

Objective = Callable[[torch.nn.Module, dict], torch.Tensor]


def on_bf16_copies(objective: Objective, unwrap: Callable[[torch.nn.Module], torch.nn.Module]) -> Objective:
    """`objective(model, batch)` run with each fp32 parameter of the model within `model` (`unwrap`: DDP's)
    replaced by its bf16 cast. The casts are autograd operations: their backward hands each fp32 parameter an
    fp32 gradient, where DDP's hooks wait for it. Tied weights stay tied. BatchNorm keeps fp32 parameters: its
    running statistics are buffers, fp32, and its kernels take bf16 inputs with fp32 parameters and statistics."""

    def on_copies(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        module = unwrap(model)
        kept = {f"{name}.{own}".lstrip(".") for name, layer in module.named_modules() if isinstance(layer, _BatchNorm)
                for own, _ in layer.named_parameters(recurse=False)}
        copies = {name: parameter.to(torch.bfloat16) for name, parameter in module.named_parameters()
                  if parameter.dtype == torch.float32 and name not in kept}
        with _reparametrize_module(module, copies, tie_weights=True):
            return objective(model, batch)

    return on_copies
