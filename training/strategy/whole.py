"""Parameters a strategy's library cannot shard, kept whole on every rank around `prepare` (`kept_whole`): a 0-dim
parameter (a learned temperature, as CLIP's `logit_scale`) under FSDP2 and DeepSpeed, and under FSDP2 one whose
dtype differs from the other trained parameters' (float64 beside float32), which `fully_shard` cannot put in one
unit. FSDP2 leaves them out (`ignored_params`) and their gradients are averaged here, at the step's last
micro-batch, as DDP averages them. DeepSpeed sees a 0-dim parameter as 1-dim while it sets up (it broadcasts every
parameter viewed as bytes, which a 0-dim tensor cannot be) and 0-dim again after: every forward and checkpoint
sees the shape the model declared. ZeRO-3 holds every trained parameter in one dtype: one of another dtype is
cast to it, and said once."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from training.errors import StrategyError

logger = get_logger(__name__)


def trained_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of most of the trained floating-point values."""
    dtypes = Counter()
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point():
            dtypes[p.dtype] += p.numel()
    return dtypes.most_common(1)[0][0] if dtypes else None


def unshardable(model: torch.nn.Module, one_dtype: bool) -> dict[str, torch.nn.Parameter]:
    """The parameters to keep whole, by name: 0-dim ones, and with `one_dtype` trained ones of a dtype other than
    `trained_dtype`."""
    common = trained_dtype(model)
    return {name: p for name, p in model.named_parameters()
            if p.dim() == 0 or (one_dtype and p.requires_grad and p.is_floating_point() and p.dtype != common)}


@contextmanager
def kept_whole(accelerator: Accelerator, model: torch.nn.Module) -> Iterator[None]:
    """Around `accelerator.prepare`: the parameters FSDP2 or DeepSpeed cannot shard (`unshardable`) kept whole."""
    if accelerator.distributed_type is DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        given = plugin.ignored_modules
        # (under mixed precision accelerate first makes every trained parameter float32)
        _ignored_by_fsdp(accelerator, model, unshardable(model, one_dtype=accelerator.mixed_precision == "no"))
        try:
            yield
        finally:
            plugin.ignored_modules = given  # (a frozen model prepared next has its own)
    elif accelerator.distributed_type is DistributedType.DEEPSPEED:
        if accelerator.state.deepspeed_plugin.zero_stage == 3:
            _one_dtype_for_zero3(model)
        # (a model built partitioned by zero.Init is never broadcast)
        scalars = [p for p in unshardable(model, one_dtype=False).values() if not hasattr(p, "ds_id")]
        for parameter in scalars:
            parameter.data = parameter.data.reshape(1)
        try:
            yield
        finally:
            for parameter in scalars:
                _declared_shape(accelerator, parameter)
    else:
        yield


@contextmanager
def scalars_gathered_1d(tensors) -> Iterator[None]:
    """ZeRO-3 gathers that write a parameter back (`GatheredParameters(modifier_rank=...)`, accelerate's whole state
    dict) broadcast it viewed as bytes: a 0-dim one is gathered 1-dim meanwhile (and held 1-dim where it is held
    whole already: a parameter under the persistence threshold)."""
    scalars = [tensor for tensor in tensors if getattr(tensor, "ds_shape", None) == torch.Size([])]
    for tensor in scalars:
        tensor.ds_shape = torch.Size([1])
        if tensor.data.numel() == 1:
            tensor.data = tensor.data.reshape(1)
    try:
        yield
    finally:
        for tensor in scalars:
            tensor.ds_shape = torch.Size([])
            if tensor.data.numel() == 1:
                tensor.data = tensor.data.reshape(())


def _one_dtype_for_zero3(model: torch.nn.Module) -> None:
    """ZeRO-3 keeps every trained parameter's partition in one buffer of one dtype (DeepSpeed 0.19.8 asserts it):
    one of another dtype (float64 beside float32) trains in the commonest, as DeepSpeed's own bf16 casts every
    parameter; its checkpoint values are then of that dtype."""
    common = trained_dtype(model)
    others = {name: p for name, p in unshardable(model, one_dtype=True).items() if p.dtype != common and
              p.requires_grad and p.is_floating_point()}
    if built_partitioned := [name for name, p in others.items() if hasattr(p, "ds_id")]:
        raise StrategyError(f"DeepSpeed ZeRO-3 built this model partitioned (zero.Init) and holds every trained "
                            f"parameter in one dtype, but {built_partitioned[0]} is {others[built_partitioned[0]].dtype}, "
                            f"the others {common}; build it in one dtype, or use deepspeed_zero2.yaml or fsdp.yaml")
    for parameter in others.values():
        parameter.data = parameter.data.to(common)
    if others:
        logger.warning(f"DeepSpeed ZeRO-3 trains every parameter in one dtype: {', '.join(others)} train in {common}",
                       main_process_only=True)


def _declared_shape(accelerator: Accelerator, parameter: torch.nn.Parameter) -> None:
    """A 0-dim parameter DeepSpeed set up as 1-dim, 0-dim again: ZeRO-3 gathers it into `ds_shape`; ZeRO-1/2 point it
    into their flat buffer after every step by the shapes they recorded (`round_robin_bit16_meta`)."""
    if hasattr(parameter, "ds_shape"):
        parameter.ds_shape = torch.Size([])
        return
    engine = getattr(accelerator.deepspeed_engine_wrapped, "engine", None)
    zero = getattr(engine, "optimizer", None)
    for group, shapes in zip(getattr(zero, "round_robin_bit16_groups", ()), getattr(zero, "round_robin_bit16_meta", ())):
        for index, held in enumerate(group):
            if held is parameter:
                shapes[index] = torch.empty((), dtype=held.dtype, device="meta")
    parameter.data = parameter.data.reshape(())


def _ignored_by_fsdp(accelerator: Accelerator, model: torch.nn.Module, whole: dict[str, torch.nn.Parameter]) -> None:
    """FSDP2 leaves `whole` out (accelerate reads them from the plugin's `ignored_modules`, as modules whose
    parameters are ignored: a holder module lists them), and each one's gradient is averaged over the data-parallel
    ranks once the step's last micro-batch has added to it."""
    if not whole:
        return
    plugin, names = accelerator.state.fsdp_plugin, ", ".join(list(whole)[:3])
    if plugin.cpu_ram_efficient_loading:
        raise StrategyError(
            f"fsdp_cpu_ram_efficient_loading broadcasts sharded parameters only, and FSDP2 cannot shard {names} (0-dim, "
            "or a dtype of its own); set `fsdp_cpu_ram_efficient_loading: false` in the accelerate config (every rank "
            "then builds the whole model)")
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None and len(accelerator.parallelism_config.fsdp_dim_names) > 1:
        raise StrategyError(f"FSDP2 cannot shard {names} (0-dim, or a dtype of its own), and with several data-parallel "
                            "dimensions there is no one group to average them over; give each shape (1,) and one dtype, "
                            "or train with fsdp.yaml")
    holder = torch.nn.Module()
    for index, parameter in enumerate(whole.values()):
        parameter.data = parameter.data.to(accelerator.device)  # (`fully_shard` moves only what it shards)
        holder.register_parameter(f"kept_whole_{index}", parameter)
    given = plugin.ignored_modules
    if isinstance(given, str):  # the config's pattern of module names
        given = [module for name, module in model.named_modules() if re.fullmatch(given, name)]
    plugin.ignored_modules = [*(given or ()), holder]
    group = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)].get_group() if mesh is not None else None

    def average(parameter: torch.nn.Parameter) -> None:
        if accelerator.sync_gradients:
            torch.distributed.all_reduce(parameter.grad, group=group)
            parameter.grad.div_(torch.distributed.get_world_size(group))

    for parameter in whole.values():
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(average)
