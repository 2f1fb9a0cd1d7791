"""Each layer sliced over the "tp" mesh with the model's own `transformers` tensor-parallel plan."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from training.errors import StrategyError


def apply_tensor_parallel(accelerator: Accelerator, model: torch.nn.Module, tp_size: int) -> torch.nn.Module:
    """Shard each layer over the "tp" mesh with the model's own `transformers` TP plan.

    accelerate does not apply a plan itself; it only checks for DTensors. Its FSDP2 path
    (accelerate 1.15) also imports `ReplicateParallel`, which transformers 5 removed, for the
    parameters outside the plan (norms): `_install_replicate_parallel` supplies it.
    """
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
