"""The model state each rank really holds (parameters, gradients, optimizer state), counted from the tensors
at the second optimizer step: summary.json's `model_state_bytes_per_rank`, which tests hold to the planner."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from training.performance import storage_bytes
from training.strategy import Strategy, wrapped_strategy


def _stepping(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def model_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, held_gradients: Iterable[torch.Tensor] = ()
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, counted from the tensors.

    `optimizer` is the torch optimizer that steps (DeepSpeed steps it on its own fp32
    partitions, the master weights, which count as optimizer state); `held_gradients` are
    gradient buffers a strategy keeps outside `param.grad`. Measure between backward and the
    optimizer step, when gradients exist.
    """
    seen: set[int] = set()
    params = list(model.parameters())
    # DeepSpeed steps one parameter group at a time (it narrows param_groups meanwhile): the
    # optimizer state names every parameter that was ever stepped.
    stepped = list({id(p): p for p in [*_stepping(optimizer), *optimizer.state]}.values())
    parameters = storage_bytes(params, seen)
    grads = [p.grad for p in params + stepped if p.grad is not None]
    gradients = storage_bytes([*grads, *held_gradients], seen)
    states = (t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))
    optimizer_state = storage_bytes(stepped, seen) + storage_bytes(states, seen)
    return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer_state}


def held_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """Gradients a strategy keeps outside `param.grad`: DeepSpeed ZeRO's partitions."""
    if wrapped_strategy(model) is not Strategy.DEEPSPEED:
        return []
    zero = model.optimizer
    found = [getattr(zero, "grad_partitions_flat_buffer", None)]  # ZeRO-3: one flat buffer
    for grads in getattr(zero, "averaged_gradients", {}).values():  # ZeRO-1/2: per parameter group
        found += [getattr(grads, "flat_partition", None), *(grads or [])]
    return [tensor for tensor in found if isinstance(tensor, torch.Tensor)]


def model_state_probe(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, held_gradients: Callable[[], list[torch.Tensor]]
) -> dict[str, int]:
    """A dict that `model_state_bytes` fills once, just before the first optimizer step whose
    parameters all have optimizer state (the second), when gradients and optimizer state exist.
    A stateless optimizer (SGD without momentum) is measured at its second step too. A run of
    fewer optimizer steps leaves it empty: not measured, rather than 0.

    A hook on the torch optimizer, so the training loop stays as it is: every strategy,
    DeepSpeed included, calls that optimizer's `step`.
    """
    measured: dict[str, int] = {}
    stepped = []

    def measure(stepping: torch.optim.Optimizer, _args, _kwargs) -> None:
        stateless = stepped and not any(stepping.state.values())
        if (stateless or all(stepping.state.get(p) for p in _stepping(stepping))) and not measured:  # state: a defaultdict
            measured.update(model_state_bytes(model, stepping, held_gradients()))
            handle.remove()
        stepped.append(True)

    handle = optimizer.register_step_pre_hook(measure)
    return measured
