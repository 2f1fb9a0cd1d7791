"""The parameters swapped for their bf16 casts while the objective runs, as `torch.func.functional_call` swaps them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.utils.stateless import _reparametrize_module


def on_bf16_copies(objective: Callable[[torch.nn.Module, dict], torch.Tensor],
                   unwrap: Callable[[torch.nn.Module], torch.nn.Module]) -> Callable:
    """`objective(model, batch)` run with each fp32 parameter of the model within `model` (`unwrap`: DDP's)
    replaced by its bf16 cast. The casts are autograd operations: their backward hands each fp32 parameter an
    fp32 gradient, where DDP's hooks wait for it. Tied weights stay tied."""

    def on_copies(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        module = unwrap(model)
        copies = {name: parameter.to(torch.bfloat16) for name, parameter in module.named_parameters()
                  if parameter.dtype == torch.float32}
        with _reparametrize_module(module, copies, tie_weights=True):
            return objective(model, batch)

    return on_copies
