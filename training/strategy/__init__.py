"""Owns verifying the strategy: the launcher's request against what accelerate set up, before training
(`verify_strategy`) and after `prepare` (`verify_prepared`), and the refusal when they differ."""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from training.errors import StrategyError


class Strategy(str, Enum):
    SINGLE = "single"
    DDP = "ddp"
    FSDP = "fsdp"
    DEEPSPEED = "deepspeed"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def requested_strategy() -> Strategy:
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return Strategy.DEEPSPEED
    if _env_flag("ACCELERATE_USE_FSDP"):
        return Strategy.FSDP
    # torchrun starts every multi-process config, even of one process (`ddp.yaml --num_processes 1`): DDP of one
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        return Strategy.DDP
    return Strategy.SINGLE


def check_launch_config(strategy: Strategy, on_cpu: bool) -> None:
    """Before any process group, reject what accelerate would fail on or silently run otherwise (same on every rank)."""
    if strategy is Strategy.DEEPSPEED and (path := os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")):
        if not Path(path).is_file():
            raise StrategyError(
                f"DeepSpeed config {path} (deepspeed_config_file in the accelerate yaml) not found from {os.getcwd()}; "
                "relative paths count from where you launch: run from the repository root or use an absolute path")
        try:
            ds_config = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise StrategyError(f"DeepSpeed config {path} is not valid JSON ({error}); fix it or start from ds_configs/")
        if sections := [key for key in ("optimizer", "scheduler") if key in ds_config]:
            raise StrategyError(
                f"DeepSpeed config {path} has its own {' and '.join(sections)} section: train.py builds the optimizer "
                "(--optim, --learning_rate, --adam_beta1/2, --weight_decay) and the schedule (--lr_scheduler_type, "
                "--warmup_steps) the same way on every strategy; remove the section and set those flags")
    if on_cpu and strategy is Strategy.FSDP and os.environ.get("FSDP_VERSION", "1") != "2":
        raise StrategyError("FSDP1 cannot run on CPU; set `fsdp_version: 2` in the accelerate config")
    if on_cpu and os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp16":
        raise StrategyError("fp16 mixed precision needs a GPU (loss scaling runs on the device) and this machine has "
                            "none; use --mixed_precision bf16 or no")


def wrapped_strategy(model: torch.nn.Module) -> Strategy:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)  # --torch_compile wraps the strategy's wrapper
    if type(model).__name__ == "DeepSpeedEngine":
        return Strategy.DEEPSPEED
    if isinstance(model, (FSDPModule, FullyShardedDataParallel)):
        return Strategy.FSDP
    if isinstance(model, DistributedDataParallel) or hasattr(model, "replica_group"):
        return Strategy.DDP  # (pipeline stages: their replicas average gradients as DDP does, parts/pipeline)
    return Strategy.SINGLE


EXPECTED_TYPES = {
    Strategy.SINGLE: {DistributedType.NO}, Strategy.DDP: {DistributedType.MULTI_CPU, DistributedType.MULTI_GPU},
    Strategy.FSDP: {DistributedType.FSDP}, Strategy.DEEPSPEED: {DistributedType.DEEPSPEED}}


def verify_strategy(accelerator: Accelerator, prepared_model: torch.nn.Module | None = None) -> Strategy:
    """Refuse to train unless the strategy in use is the configured one (again with the model after `prepare`)."""
    requested = requested_strategy()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != world_size:
        raise StrategyError(
            f"{world_size} processes were launched but accelerate sees {accelerator.num_processes}: "
            "each would train alone. Launch with `accelerate launch --config_file accelerate_configs/<strategy>.yaml`")
    if accelerator.num_processes > 1 and accelerator.distributed_type is DistributedType.NO:
        raise StrategyError(
            f"{accelerator.num_processes} processes but no distributed strategy: gradients would never be synchronised")
    if accelerator.distributed_type not in EXPECTED_TYPES[requested]:
        raise StrategyError(
            f"the config asked for {requested.value} but accelerate set up {accelerator.distributed_type.value}")
    if prepared_model is not None:
        wrapped = wrapped_strategy(prepared_model)
        # accelerate gives one GPU process no DDP wrapper (`use_distributed` needs 2), unlike one on CPU
        ddp_of_one = requested is Strategy.DDP and wrapped is Strategy.SINGLE and accelerator.num_processes == 1
        if wrapped is not requested and not ddp_of_one:
            raise StrategyError(f"the config asked for {requested.value} but the model is wrapped for {wrapped.value}")
        if requested is Strategy.FSDP and accelerator.is_fsdp2 is not (os.environ.get("FSDP_VERSION") == "2"):
            raise StrategyError("the FSDP version in use differs from the config's fsdp_version")
    return requested


def _auto_keys(config: dict, prefix: str = "") -> list[str]:
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += _auto_keys(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(prefix + key)
    return found


def master_weight_dtypes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[torch.dtype]:
    """The dtypes of the weights the optimizer updates (DeepSpeed keeps its own flat copies)."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        zero = model.optimizer  # ZeRO-3 and ZeRO-1/2 name their fp32 partitions differently
        partitions = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
        return {partition.dtype for partition in partitions}
    return {param.dtype for group in optimizer.param_groups for param in group["params"]}


def verify_prepared(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                    per_device_batch: int, max_grad_norm: float) -> None:
    """After `prepare`: what runs is what train.py asked for; master weights stay fp32 or wider (bf16 ones learn
    worse; a model's own float64 parameters are kept)."""
    verify_strategy(accelerator, model)
    if narrow := {dtype for dtype in master_weight_dtypes(model, optimizer) if dtype.itemsize < 4}:
        raise StrategyError(f"optimizer master weights are {narrow}, not float32")
    if wrapped_strategy(model) is not Strategy.DEEPSPEED:
        return
    leftover = _auto_keys(accelerator.state.deepspeed_plugin.deepspeed_config)
    if leftover:
        raise StrategyError(f"DeepSpeed config values still 'auto' after prepare: {leftover}")
    expected = {"micro-batch": (model.train_micro_batch_size_per_gpu(), per_device_batch),
                "gradient accumulation": (model.gradient_accumulation_steps(), accelerator.gradient_accumulation_steps),
                "gradient clipping": (model.gradient_clipping(), max_grad_norm),
                "bf16": (model.bfloat16_enabled(), accelerator.mixed_precision == "bf16"),
                "fp16": (model.fp16_enabled(), accelerator.mixed_precision == "fp16")}
    for name, (engine_value, ours) in expected.items():
        if engine_value != ours:
            raise StrategyError(
                f"DeepSpeed runs with {name} {engine_value} but train.py asked for {ours}; "
                'set that key to "auto" in the DeepSpeed JSON (clipping: to --max_grad_norm)')
    # Under offload accelerate 1.15 swaps in its own DeepSpeedCPUAdam (only lr and weight decay kept)
    stepped = model.optimizer.optimizer  # what DeepSpeed's ZeRO wrapper steps
    if stepped is not scheduler.scheduler.optimizer:
        raise StrategyError(
            f"DeepSpeed replaced train.py's optimizer with {type(stepped).__name__} (different betas/eps, and the "
            'schedule would not reach it); set "zero_force_ds_cpu_optimizer": false in the DeepSpeed JSON')


def bare_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The module inside the strategy's wrapper and torch.compile's, for use during training. Not accelerate's
    default unwrap (`keep_torch_compile=True`), which points torch.compile's wrapper at the module inside DDP: the
    compiled step, traced again, then skipped DDP, and gradients were no longer averaged after a checkpoint."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)
