"""Owns every difference between strategies that code must handle: what each needs before `prepare` to train what
train.py asks for (`align_with_strategy`), and the few reads and saves that differ per wrapper."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from training.batchnorm import batch_norm_layers, running_statistics
from training.errors import StrategyError
from training.performance import compute_dtype
from training.parts import ModelRunner
from training.strategy import Strategy, wrapped_strategy


def optimizer_offload_device(accelerator: Accelerator) -> str:
    """Where ZeRO keeps and steps the optimizer: "cpu" or "nvme" under offload, else "none"."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return "none"
    return plugin.deepspeed_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")


def config_name(accelerator: Accelerator, strategy: Strategy) -> str:
    """The strategy as its config file is named (ddp, fsdp, deepspeed_zero3_offload): what a checkpoint records."""
    if strategy is not Strategy.DEEPSPEED:
        return strategy.value
    offload = "_offload" if optimizer_offload_device(accelerator) != "none" else ""
    return f"deepspeed_zero{accelerator.state.deepspeed_plugin.zero_stage}{offload}"


def align_with_strategy(accelerator: Accelerator, model: torch.nn.Module, max_grad_norm: float, per_device_batch: int) -> None:
    """Before the optimizer and `prepare`: make the strategy run what train.py asks for."""
    half = compute_dtype(accelerator.mixed_precision)
    if accelerator.distributed_type is DistributedType.FSDP:
        answer_none_for_missing_embeddings(model)
        if accelerator.state.fsdp_plugin.cpu_ram_efficient_loading and (buffers := persistent_buffers(model)):
            raise StrategyError(
                f"fsdp_cpu_ram_efficient_loading broadcasts only parameters from rank 0, and this model has buffers "
                f"that are saved with it ({', '.join(buffers[:3])}...); set `fsdp_cpu_ram_efficient_loading: false` "
                "in the accelerate config (every rank then builds the whole model)")
        if half is not torch.float32:
            keep_batch_norm_in_fp32(model, accelerator)
            _reduce_gradients_in_fp32(accelerator)
    if accelerator.state.deepspeed_plugin is not None:
        align_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, max_grad_norm, per_device_batch)
        if half is not torch.float32:
            batch_norm_statistics_in(model, half)
            keep_frozen_values(model, accelerator.process_index, accelerator.num_processes)


def persistent_buffers(model: torch.nn.Module) -> list[str]:
    """Names of the buffers in the model's state dict (BatchNorm statistics; not rotary tables)."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in model.state_dict() if name not in parameters]


def answer_none_for_missing_embeddings(model: torch.nn.Module) -> None:
    """accelerate 1.15's FSDP2 expects None from models without input embeddings; `transformers` raises instead."""
    try:
        model.get_input_embeddings()
    except (NotImplementedError, AttributeError):  # (a plain nn.Module has no such method: accelerate then skips it)
        model.get_input_embeddings = lambda: None


def _reduce_gradients_in_fp32(accelerator: Accelerator) -> None:
    """accelerate's FSDP2 bf16/fp16 policy reduces gradients in 8 mantissa bits: use fp32, as torchtitan and DDP do."""
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version == 2 and plugin.mixed_precision_policy is not None:
        plugin.mixed_precision_policy = dataclasses.replace(plugin.mixed_precision_policy, reduce_dtype=torch.float32)


def gradient_reduction_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The dtypes the ranks average gradients in (DeepSpeed's default under bf16: bf16)."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        return {model.communication_data_type}
    states = [module._get_fsdp_state() for module in model.modules() if hasattr(module, "_get_fsdp_state")]
    if states:  # no reduce_dtype: the param_dtype, else the (fp32) parameters'
        return {state._mp_policy.reduce_dtype or state._mp_policy.param_dtype or torch.float32 for state in states}
    return {param.dtype for param in model.parameters() if param.requires_grad}


def keep_batch_norm_in_fp32(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """FSDP2 casts BatchNorm weights to bf16, not running stats, which BatchNorm refuses (pytorch/torchtitan#674).
    Its output goes on in the compute dtype: the layer after it may be in no unit of its own that casts its input."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                output_dtype=compute_dtype(accelerator.mixed_precision))
    for layer in batch_norm_layers(model):
        fully_shard(layer, mp_policy=fp32, reshard_after_forward=accelerator.state.fsdp_plugin.reshard_after_forward)


def batch_norm_statistics_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """DeepSpeed's half-precision engines cast parameters, not buffers; BatchNorm needs both in one dtype."""
    for buffer in running_statistics(model):
        buffer.data = buffer.to(dtype)


def align_deepspeed_config(config: dict, max_grad_norm: float, per_device_batch: int) -> None:
    """Fill DeepSpeed's "auto"s from our flags: accelerate would clip at 1.0 and take the smallest (eval's) batch."""
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = per_device_batch
    clipping = config.get("gradient_clipping", "auto")
    if clipping == "auto":
        config["gradient_clipping"] = max_grad_norm
    elif float(clipping) != max_grad_norm:
        raise StrategyError(
            f"gradient_clipping is {clipping} in the DeepSpeed JSON but --max_grad_norm is {max_grad_norm}; "
            'set "gradient_clipping": "auto" in the JSON so the flag decides')


def bare_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The module inside the strategy's wrapper and torch.compile's, for use during training. Not accelerate's
    default unwrap (`keep_torch_compile=True`), which points torch.compile's wrapper at the module inside DDP: the
    compiled step, traced again, then skipped DDP, and gradients were no longer averaged after a checkpoint."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor | float:
    """The norm before clipping, on the device (DeepSpeed clips in its step; accelerate's `.item()` would sync)."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        return model.get_global_grad_norm()
    if isinstance(model, ModelRunner):  # a part's model that clips itself (pipeline stages: the norm over every stage)
        return model.clip_grad_norm_(max_norm)
    return accelerator.clip_grad_norm_(model.parameters(), max_norm)


def write_effective_deepspeed_config(accelerator: Accelerator, output_dir: str) -> None:
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and accelerator.is_main_process:
        path = Path(output_dir) / "deepspeed_config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plugin.deepspeed_config, indent=2, default=str))


@contextmanager
def own_class_while_saving(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2 makes the model an `FSDP<Model>`: a custom model's `save_pretrained` would copy that into `auto_map`."""
    from torch.distributed.fsdp import FSDPModule

    fsdp_class = type(model)
    if FSDPModule not in fsdp_class.__bases__:
        yield
        return
    model.__class__ = next(base for base in fsdp_class.__bases__ if base is not FSDPModule)
    try:
        yield
    finally:
        model.__class__ = fsdp_class


# The checkpoint's model state, one tensor at a time in the same terms under every strategy (training/checkpoint.py):
# the pieces of its fp32 value and optimizer state that this rank holds, or the whole of them set into its layout. A
# piece is (its offset in the flattened whole, fp32 values). Optimizer state not shaped like its tensor (a step count,
# Adafactor's factored moments) is kept as the optimizer holds it, a tensor or a number, under offset None.

Piece = tuple[int | None, torch.Tensor | float | int]


@dataclass
class TensorState:
    """One tensor of the checkpoint, whole: its fp32 value, the optimizer state shaped like it, and the rest."""

    value: torch.Tensor
    elementwise: dict[str, torch.Tensor] = field(default_factory=dict)  # AdamW's moments
    other: dict[str, torch.Tensor | float | int] = field(default_factory=dict)  # a step count, factored moments


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (a tied one once) and persistent buffers, by the names of the model as the task built it. FSDP2's
    are its sharded ones, which the optimizer steps: the root module stays unsharded after a forward without backward
    (evaluation's), so it is resharded first."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    tensors = dict(model.named_parameters())
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            tensors[name] = buffer
    return tensors


def whole_shape(tensor: torch.Tensor) -> list[int]:
    """A tensor's shape as the model defines it (a ZeRO-3 parameter holds a partition and knows the whole shape)."""
    return list(getattr(tensor, "ds_shape", tensor.shape))


FROZEN_SHARE = "frozen_share"  # (offset, fp32 values): a frozen parameter's share kept by `keep_frozen_values`


def keep_frozen_values(model: torch.nn.Module, rank: int, processes: int) -> None:
    """DeepSpeed's half-precision engines cast the whole model and keep fp32 copies of the trained parameters only:
    before `prepare`, each rank keeps its share of every frozen parameter as built (`FROZEN_SHARE`), which is what
    checkpoints hold. (A model built partitioned by zero.Init never had other values.)"""
    for parameter in model.parameters():
        kept = hasattr(parameter, FROZEN_SHARE) or hasattr(parameter, "ds_id")  # (prepared again: already cast)
        if not parameter.requires_grad and parameter.is_floating_point() and not kept:
            size = -(-parameter.numel() // processes)
            start = min(rank * size, parameter.numel())
            setattr(parameter, FROZEN_SHARE, (start, _flat(parameter)[start:start + size].clone()))


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that steps, inside accelerate's wrapper and DeepSpeed's ZeRO optimizer, its state ready to
    be read or set per parameter. ZeRO makes that state at its first step (before it, a step that changes nothing
    makes it); ZeRO-1/2 link it to each parameter's fragment after their first group's step (DeepSpeed 0.19.8: the
    other groups' links stay empty), so it is linked again here."""
    while hasattr(optimizer, "optimizer"):
        zero, optimizer = optimizer, optimizer.optimizer
        if type(zero).__module__.startswith("deepspeed.runtime.zero") and not any(optimizer.state.values()):
            make_zero_state(zero, optimizer)
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()
    return optimizer


def make_zero_state(zero, optimizer: torch.optim.Optimizer) -> None:
    """ZeRO's optimizer state, made by a step that changes nothing. ZeRO-3 hands the optimizer one flat partition at a
    time (its groups are empty between steps); ZeRO-1/2 leave theirs in place."""
    partitions = getattr(zero, "fp32_partitioned_groups_flat", None)
    if partitions is None:
        step_without_change(optimizer)
        return
    for index, partition in enumerate(partitions):
        group = optimizer.param_groups[zero.sub_group_to_group_id[index]]
        group["params"] = [partition]
        step_without_change(optimizer)
        group["params"] = []


def step_without_change(optimizer: torch.optim.Optimizer) -> None:
    """One step with zero gradients at learning rate 0: the optimizer's state made as its first step makes it."""
    rates = [group["lr"] for group in optimizer.param_groups]
    gradients = [(parameter, parameter.grad) for group in optimizer.param_groups for parameter in group["params"]]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for parameter, _ in gradients:
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    for parameter, gradient in gradients:  # (ZeRO-3 under offload keeps its gradient buffers there)
        parameter.grad = gradient


def held_pieces(tensor: torch.Tensor, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Piece]:
    """What this rank writes of `tensor`, per key ("value", then its optimizer state's), without communication: the
    pieces it holds (a ZeRO partition, FSDP2's rows, a frozen share), and the rest of the optimizer state where every
    rank holds the same (rank 0 writes it); nothing where another rank writes it (a replicated tensor: rank 0). A
    DTensor split otherwise (tensor parallelism) is gathered (a collective on every rank). `optimizer`: the base one."""
    if hasattr(tensor, FROZEN_SHARE):
        start, share = getattr(tensor, FROZEN_SHARE)
        return {"value": (start, share)} if share.numel() else {}
    if hasattr(tensor, "ds_id") or hasattr(tensor, "_hp_mapping"):
        return _zero_pieces(tensor, optimizer)
    state = {"value": tensor, **optimizer.state.get(tensor, {})}
    if hasattr(tensor, "device_mesh"):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if tuple(tensor.placements) == (Shard(0),):  # FSDP2: a slice of rows (none on some ranks), contiguous
            shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
            start = offset[0] * math.prod(tensor.shape[1:])
            rows = {key: (start, _flat(value)) for key, value in state.items() if _elementwise(value, tensor)}
            return ({} if not math.prod(shape) else rows) | (_others(state, tensor) if rank == 0 else {})
        state = {key: value.full_tensor() if hasattr(value, "full_tensor") else value for key, value in state.items()}
    if rank != 0:
        return {}
    return {key: (0, _flat(value)) for key, value in state.items() if _elementwise(value, tensor)} | _others(state, tensor)


def _elementwise(value, tensor: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == tensor.shape


def _others(state: dict, tensor: torch.Tensor) -> dict[str, Piece]:
    """The optimizer state not shaped like `tensor`, as the optimizer holds it."""
    return {key: (None, _kept(value)) for key, value in state.items() if not _elementwise(value, tensor)}


def _kept(value: torch.Tensor | float | int) -> torch.Tensor | float | int:
    return _local(value).detach().cpu().clone() if torch.is_tensor(value) else value


def _flat(tensor: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(_local(tensor)).detach().float().cpu().reshape(-1)


def _zero3_range(tensor: torch.Tensor) -> tuple[int, int, int]:
    """A ZeRO-3 parameter's partition on this rank: its offset in the whole, its size (the last rank's padded to the
    others'), and how many of the whole's values it holds."""
    import torch.distributed as dist

    size = tensor.ds_tensor.numel()
    start = dist.get_rank(group=tensor.ds_process_group) * size
    return start, size, max(0, min(size, tensor.ds_numel - start))


def _zero_pieces(tensor: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict[str, Piece]:
    """ZeRO's fp32 partition of a parameter and its optimizer state: ZeRO-3 holds every parameter's slice at the
    rank's place, ZeRO-1/2 a range of some parameters (`_hp_mapping`; the ones it does not step are whole on every
    rank, `held_pieces`' replicated tensors). ZeRO steps flat partitions, so the rest of the state (the step count)
    is one for all, written by every rank that holds a piece."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    stepped = next(iter(optimizer.state.values()), {}) if tensor.requires_grad else {}
    keys = [key for key, value in stepped.items() if torch.is_tensor(value) and value.dim()]
    others = {key: (None, _kept(value)) for key, value in stepped.items() if key not in keys}
    if hasattr(tensor, "ds_id"):
        start, _, held = _zero3_range(tensor)
        if not held:
            return {}
        if not tensor.requires_grad:
            return {"value": (start, _flat(tensor.ds_tensor)[:held])}
        pieces = {"value": safe_get_local_fp32_param(tensor),
                  **{key: safe_get_local_optimizer_state(tensor, key) for key in keys}}
        # (copies: the pieces are views of one flat buffer, which a safetensors file cannot hold twice)
        return {key: (start, _flat(piece)[:held].clone()) for key, piece in pieces.items()} | others
    if tensor._hp_mapping is None:  # no range of this parameter here
        return {}
    mapping = tensor._hp_mapping  # (DeepSpeed's local accessors are for ZeRO-3 only)
    pieces = {"value": mapping.get_hp_fragment(), **{key: mapping.get_hp_fragment(key) for key in keys}}
    return {key: (mapping.lp_fragment_address.start, _flat(piece).clone()) for key, piece in pieces.items()} | others


def set_full_state(tensor: torch.Tensor, saved: TensorState, optimizer: torch.optim.Optimizer,
                   torch_states: dict[int, dict]) -> None:
    """Set `tensor` and its optimizer state from their whole values (training/checkpoint.py `ModelState.whole`), on
    every rank: ZeRO's partitions at once, a torch optimizer's into `torch_states` (by the tensor's id), for
    `load_optimizer_states`."""
    value = saved.value
    if hasattr(tensor, FROZEN_SHARE):  # what the next checkpoint holds
        start, share = getattr(tensor, FROZEN_SHARE)
        share.copy_(value.reshape(-1)[start:start + share.numel()])
    if hasattr(tensor, "ds_id") or hasattr(tensor, "_hp_mapping"):
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([tensor], modifier_rank=0, enabled=hasattr(tensor, "ds_id")):
            tensor.data.copy_(value)  # the weights forward uses (ZeRO-3: rank 0's, partitioned again on leaving)
        if tensor.requires_grad:
            _set_zero_state(tensor, saved)
        for stepped in optimizer.state.values():  # ZeRO steps flat partitions: one count for all
            for key, count in saved.other.items():
                if key in stepped:
                    number = count.item() if torch.is_tensor(count) else count
                    stepped[key] = (stepped[key].fill_(number) if torch.is_tensor(stepped[key])
                                    else type(stepped[key])(number))
        return
    with torch.no_grad():
        _local(tensor).copy_(_local(_shard_like(tensor, value)))
    if saved.elementwise or saved.other:
        torch_states[id(tensor)] = {key: _shard_like(tensor, state) for key, state in saved.elementwise.items()} | \
            saved.other


def _set_zero_state(tensor: torch.Tensor, saved: TensorState) -> None:
    """ZeRO's fp32 master and optimizer state of a parameter it steps. ZeRO-3's from this rank's padded partition
    (DeepSpeed 0.19.8's `safe_set_full_fp32_param` reads past the whole where the process count does not divide it)."""
    from deepspeed.utils import (safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                 safe_set_local_optimizer_state)

    if not hasattr(tensor, "ds_id"):
        safe_set_full_fp32_param(tensor, saved.value.to(tensor.device))
        for key, state in saved.elementwise.items():
            safe_set_full_optimizer_state(tensor, state.to(tensor.device), key)
        return
    start, size, held = _zero3_range(tensor)

    def partition(whole: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(size)
        padded[:held] = whole.reshape(-1)[start:start + held]
        return padded.to(tensor.ds_tensor.device)

    safe_set_local_fp32_param(tensor, partition(saved.value))
    for key, state in saved.elementwise.items():
        safe_set_local_optimizer_state(tensor, partition(state), key)


def _local(tensor: torch.Tensor | float) -> torch.Tensor | float:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _shard_like(tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` laid out as `tensor` is: a DTensor's own shard (every rank read the whole: no communication)."""
    if not hasattr(tensor, "device_mesh"):
        return value.to(tensor.device)
    from torch.distributed.tensor import DTensor, distribute_tensor

    shard = distribute_tensor(value.to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None)
    # its own copy: a view would keep the whole tensor alive, on every rank, as long as the optimizer state
    return DTensor.from_local(shard.to_local().clone(), tensor.device_mesh, tensor.placements, run_check=False,
                              shape=shard.shape, stride=shard.stride())


def load_optimizer_states(optimizer: torch.optim.Optimizer, torch_states: dict[int, dict]) -> None:
    """A torch optimizer's state from `set_full_state`'s, through its `load_state_dict` (dtypes, devices, steps)."""
    if not torch_states:
        return
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()
    saved["state"] = {index: torch_states[id(p)] for index, p in enumerate(parameters) if id(p) in torch_states}
    optimizer.load_state_dict(saved)
