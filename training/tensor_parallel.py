"""Owns tensor parallelism: each layer sliced over the "tp" mesh with the model's own transformers plan.

Switched on by `parallelism_config_tp_size` in the accelerate config; also what the slicing
changes for batches (data-parallel size, gathering eval results once per batch)."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from training.errors import StrategyError


def tensor_parallel_size(accelerator: Accelerator) -> int:
    """Processes that share one batch, each computing a slice of every layer (`parallelism_config_tp_size`)."""
    config = accelerator.parallelism_config
    return config.tp_size if config is not None else 1

def data_parallel_size(accelerator: Accelerator) -> int:
    """Processes that see different batches: the global batch is this x per-device batch x accumulation."""
    return accelerator.num_processes // tensor_parallel_size(accelerator)

def apply_tensor_parallel(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """With `parallelism_config_tp_size` > 1, shard each layer over the "tp" mesh with the model's own
    `transformers` TP plan (before the optimizer is built: the parameters become DTensors).

    accelerate does not apply a plan itself; it only checks for DTensors. Its FSDP2 path
    (accelerate 1.15) also imports `ReplicateParallel`, which transformers 5 removed, for the
    parameters outside the plan (norms): `_install_replicate_parallel` supplies it.
    """
    tp_size = tensor_parallel_size(accelerator)
    if tp_size == 1:
        return model
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan, config = tensor_parallel_plan(model, tp_size)
    mesh = accelerator.torch_device_mesh["tp"]
    model = apply_tensor_parallelism(model, mesh, plan)
    # accelerate reads the TP size from the config; save_pretrained gathers the shards through the mesh.
    model.config.distributed_config = config
    model._tp_size, model._device_mesh = tp_size, mesh
    _install_replicate_parallel()
    return model

def tensor_parallel_plan(model: torch.nn.Module, tp_size: int) -> tuple[dict[str, str], object]:
    """The model's `transformers` TP plan with `layers.*` spelled out, and its DistributedConfig."""
    from transformers import DistributedConfig

    if not getattr(model, "tp_plan", None):
        raise StrategyError(
            f"{type(model).__name__} has no tensor-parallel plan in transformers; train it with a config without "
            "parallelism_config_tp_size (e.g. fsdp.yaml)"
        )
    config = DistributedConfig(tp_size=tp_size)
    plan, _, _ = model._resolve_parallel_plans(config)
    return plan, config

def _install_replicate_parallel() -> None:
    """The `ReplicateParallel` accelerate 1.15 expects: a module whose parameters accelerate made
    replicated DTensors runs its forward on the local tensors (as axolotl does for the same gap)."""
    import transformers.integrations.tensor_parallel as legacy
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    if hasattr(legacy, "ReplicateParallel"):
        return

    class ReplicateParallel(TensorParallelLayer):
        def should_use_local_tensors(self, module: torch.nn.Module) -> bool:
            return True

        def prepare_module_tp(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
            if "forward" not in vars(module):  # accelerate calls this once per parameter: wrap each module once
                self.install_forward(module, device_mesh)
            return module

    legacy.ReplicateParallel = ReplicateParallel

def gather_once_per_batch(per_example: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
    """`gather_for_metrics`, counting each tensor-parallel group's batch once: the ranks of a
    group see the same batch, and accelerate 1.15's `gather_for_metrics` would count them all
    and cut the last batch at the wrong place."""
    tp_size = tensor_parallel_size(accelerator)
    if tp_size == 1:
        return accelerator.gather_for_metrics(per_example)
    gathered = accelerator.gather(per_example)  # rank order: the tp ranks of one batch are neighbours
    gathered = gathered.view(accelerator.num_processes, -1, *per_example.shape[1:])[::tp_size].flatten(0, 1)
    state = accelerator.gradient_state
    return gathered[: state.remainder] if state.end_of_dataloader and state.remainder > 0 else gathered
