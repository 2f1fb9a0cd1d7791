"""Tensor parallelism (accelerate_configs/fsdp_tp.yaml): each layer sliced over the "tp" mesh with the model's own
`transformers` plan (slicing.py), beside FSDP2's sharding, on the grid of accelerate's `parallelism_config`. The
ranks of a tp group read the same batch. See docs/tensor_parallel.md.
"""

from __future__ import annotations

import logging
import math
import os

from training.parts import Launch, Part, Started


def tp_size() -> int:
    """Processes that share one batch, each computing a slice of every layer, as the launcher's config asks."""
    return int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1"))


class TensorParallel(Part):
    name = "tensor_parallel"
    description = "every layer sliced over a group of processes, with FSDP2 (accelerate_configs/fsdp_tp.yaml)"
    files = ("accelerate_configs/fsdp_tp.yaml",)

    def check_launch(self, launch: Launch) -> None:
        """The launcher's `parallelism_config` (tensor parallelism here) fits the processes launched."""
        if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
            return
        from training.errors import StrategyError
        from training.strategy import Strategy

        sizes = {name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
                 for name in ("dp_replicate", "dp_shard", "tp", "cp")}
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        grid = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1) or "1"
        if launch.strategy is not Strategy.FSDP:
            raise StrategyError("parallelism_config in the accelerate yaml needs distributed_type: FSDP with "
                                "fsdp_version: 2 (start from accelerate_configs/fsdp_tp.yaml)")
        if sizes["cp"] > 1 or sizes["dp_replicate"] > 1:
            raise StrategyError(f"parallelism_config {grid}: train.py runs dp_shard x tp only (no context parallelism "
                                "or HSDP replication yet); set the other sizes to 1")
        if (grid_size := math.prod(sizes.values())) != world_size:
            raise StrategyError(f"parallelism_config is {grid} = {grid_size} processes but {world_size} were "
                                "launched; make the sizes multiply to num_processes")
        if sizes["dp_shard"] < 2:
            raise StrategyError(f"FSDP2 with tensor parallelism needs parallelism_config_dp_shard_size >= 2 (got "
                                f"{grid}): at least 2 x tp_size processes; for one model split over all processes, use "
                                "fsdp.yaml")

    def model_split(self, flags) -> str | None:
        return "tensor parallelism (fsdp_tp.yaml)" if tp_size() > 1 else None

    def ranks_per_batch(self, args) -> int:
        return tp_size()

    def wrap_model(self, model, run: Started):
        """Each layer sliced over the tp mesh (before the optimizer is built: the parameters become DTensors)."""
        if tp_size() == 1:
            return model
        from accelerate.logging import get_logger

        from parts.tensor_parallel.slicing import apply_tensor_parallel

        # torch 2.13 warns for each tensor gathered whole (a checkpoint's model_state/, training/checkpoints/tensors.py)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        get_logger(__name__).info(f"tensor parallel: every layer sliced over tp={tp_size()} processes "
                                  f"(data-parallel {run.accelerator.num_processes // tp_size()})", main_process_only=True)
        return apply_tensor_parallel(run.accelerator, model, tp_size())


PART = TensorParallel()
