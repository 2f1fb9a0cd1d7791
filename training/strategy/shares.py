"""Model-shaped state per rank, in the same terms under every strategy: of each parameter (or persistent buffer), the
share this rank holds (`shares_of`: a ZeRO partition, FSDP2's rows, a frozen share, the whole where every rank holds
it), with the optimizer state shaped like it; and values written back where the run keeps them (`write_value`,
`write_shares`): the master the optimizer steps (ZeRO's fp32 partitions) and the weights the forward reads (FSDP2's
shards, ZeRO-3's partitions with its persistent parameters gathered again, ZeRO-1/2's whole weights on every rank).

A share is (its offset in the flattened whole, its values, flat). The core's checkpoints (training/checkpoints/
tensors.py) save and load the model through it, and a part keeps model-shaped state of its own through it (parts/ema:
an average of the weights, shaped as each rank's share, saved in the same tensor format).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from training.strategy import bare_model

FROZEN_SHARE = "frozen_share"  # (offset, values as built): a frozen parameter's share kept by `keep_frozen_values`


@dataclass(frozen=True)
class Share:
    """This rank's share of one tensor (or of its optimizer state): where it starts in the flattened whole, and its
    values, flat, on the device the run keeps them (a view of them where the strategy allows)."""

    start: int
    values: torch.Tensor
    replicated: bool = False  # every rank holds the same values (DDP, one process): one rank writes them


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


def trained_parameters(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters the optimizer steps, by name, of the model as prepared."""
    return {name: tensor for name, tensor in model_tensors(bare_model(accelerator, model)).items()
            if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad}


def whole_shape(tensor: torch.Tensor) -> list[int]:
    """A tensor's shape as the model defines it (a ZeRO-3 parameter holds a partition and knows the whole shape)."""
    return list(getattr(tensor, "ds_shape", tensor.shape))


def keep_frozen_values(model: torch.nn.Module, rank: int, processes: int) -> None:
    """DeepSpeed's half-precision engines cast the whole model and keep fp32 copies of the trained parameters only:
    before `prepare`, each rank keeps its share of every frozen parameter as built, in its own dtype (`FROZEN_SHARE`),
    which is what checkpoints hold. (A model built partitioned by zero.Init never had other values.)"""
    for parameter in model.parameters():
        kept = hasattr(parameter, FROZEN_SHARE) or hasattr(parameter, "ds_id")  # (prepared again: already cast)
        if not parameter.requires_grad and parameter.is_floating_point() and not kept:
            size = -(-parameter.numel() // processes)
            start = min(rank * size, parameter.numel())
            setattr(parameter, FROZEN_SHARE, (start, parameter.detach().cpu().reshape(-1)[start:start + size].clone()))


def stepped_by_zero(tensor: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO holds `tensor` (a ZeRO-3 partition, or ZeRO-1/2's mapping to its fp32 fragment)."""
    return hasattr(tensor, "ds_id") or hasattr(tensor, "_hp_mapping")


def shares_of(tensor: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Share]:
    """This rank's share of `tensor`'s value (`"value"`: what the optimizer steps, ZeRO's fp32 master) and of its
    optimizer state shaped like it (AdamW's moments), by key; {} where this rank holds none of it. A DTensor split
    otherwise than by rows (tensor parallelism) is gathered whole: a collective on every rank. `optimizer`: the torch
    optimizer that steps (training/checkpoints/tensors.py `base_optimizer`), or None for the value alone."""
    if hasattr(tensor, FROZEN_SHARE):
        start, share = getattr(tensor, FROZEN_SHARE)
        return {"value": Share(start, share)} if share.numel() else {}
    if stepped_by_zero(tensor):
        return _zero_shares(tensor, optimizer)
    state = {"value": tensor.detach(), **(optimizer.state.get(tensor, {}) if optimizer is not None else {})}
    state = {key: value for key, value in state.items() if _elementwise(value, tensor)}
    if hasattr(tensor, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if _rows(tensor):  # FSDP2: a slice of rows (none on some ranks), contiguous
            shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
            start = offset[0] * math.prod(tensor.shape[1:])
            return {key: Share(start, value.to_local().reshape(-1)) for key, value in state.items()} if math.prod(
                shape) else {}
        return {key: Share(0, value.full_tensor().reshape(-1), replicated=True) for key, value in state.items()}
    return {key: Share(0, value.reshape(-1), replicated=True) for key, value in state.items()}


def other_optimizer_state(tensor: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor | float]:
    """The optimizer state of `tensor` not shaped like it (a step count, Adafactor's factored moments), as the
    optimizer holds it. ZeRO steps flat partitions: one step count for all."""
    if hasattr(tensor, FROZEN_SHARE):
        return {}
    if stepped_by_zero(tensor):
        stepped = next(iter(optimizer.state.values()), {}) if tensor.requires_grad else {}
        return {key: value for key, value in stepped.items() if not (torch.is_tensor(value) and value.dim())}
    return {key: value for key, value in optimizer.state.get(tensor, {}).items() if not _elementwise(value, tensor)}


def _rows(tensor: torch.Tensor) -> bool:
    """A DTensor sharded by rows alone (FSDP2's): each rank's share is contiguous in the flattened whole."""
    from torch.distributed.tensor import Shard

    return tuple(tensor.placements) == (Shard(0),)


def _elementwise(value, tensor: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == tensor.shape


def zero3_range(tensor: torch.Tensor) -> tuple[int, int, int]:
    """A ZeRO-3 parameter's partition on this rank: its offset in the whole, its size (the last rank's padded to the
    others'), and how many of the whole's values it holds."""
    import torch.distributed as dist

    size = tensor.ds_tensor.numel()
    start = dist.get_rank(group=tensor.ds_process_group) * size
    return start, size, max(0, min(size, tensor.ds_numel - start))


def _zero_shares(tensor: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> dict[str, Share]:
    """ZeRO's fp32 partition of a parameter and its optimizer state: ZeRO-3 holds every parameter's slice at the
    rank's place, ZeRO-1/2 a range of some parameters (`_hp_mapping`; the ones it does not step are whole on every
    rank: `shares_of`' replicated tensors)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    stepped = next(iter(optimizer.state.values()), {}) if optimizer is not None and tensor.requires_grad else {}
    keys = [key for key, value in stepped.items() if torch.is_tensor(value) and value.dim()]
    if hasattr(tensor, "ds_id"):
        start, _, held = zero3_range(tensor)
        if not held:
            return {}
        if not tensor.requires_grad:
            return {"value": Share(start, tensor.ds_tensor.reshape(-1)[:held])}
        shares = {"value": safe_get_local_fp32_param(tensor),
                  **{key: safe_get_local_optimizer_state(tensor, key) for key in keys}}
        return {key: Share(start, share.reshape(-1)[:held]) for key, share in shares.items()}
    mapping = tensor._hp_mapping  # (DeepSpeed's local accessors are for ZeRO-3 only)
    if mapping is None:  # no range of this parameter here
        return {}
    start = mapping.lp_fragment_address.start
    return {"value": Share(start, mapping.get_hp_fragment().reshape(-1)),
            **{key: Share(start, mapping.get_hp_fragment(key).reshape(-1)) for key in keys}}


def write_value(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """On every rank, without communication: `tensor`'s whole value written where this rank keeps it, the master the
    optimizer steps and the weights the forward reads (cast to their dtypes)."""
    flat = whole.reshape(-1)
    if hasattr(tensor, FROZEN_SHARE):  # what the next checkpoint holds
        start, share = getattr(tensor, FROZEN_SHARE)
        share.copy_(flat[start:start + share.numel()])
    if hasattr(tensor, "ds_id"):
        start, _, held = zero3_range(tensor)
        _write_zero3(tensor, flat[start:start + held])
        if tensor.data.numel() == tensor.ds_numel:  # held whole (a persistent parameter, gathered)
            tensor.data.copy_(flat.view(tensor.data.shape))
        return
    if hasattr(tensor, "_hp_mapping"):
        if tensor._hp_mapping is not None:
            address = tensor._hp_mapping.lp_fragment_address
            tensor._hp_mapping.get_hp_fragment().data.copy_(flat[address.start:address.start + address.numel])
        tensor.data.copy_(flat.view(tensor.data.shape))
        return
    with torch.no_grad():
        _local(tensor).copy_(_local(shard_like(tensor, whole.reshape(tensor.shape))))


def write_shares(accelerator: Accelerator, model: torch.nn.Module, values: dict[str, torch.Tensor | None]) -> None:
    """On every rank, for the trained parameters `values` names (the same names on every rank): this rank's share of
    each (laid out as `shares_of(...)["value"]`; None where it holds none) written where the run keeps it, the master
    and the weights the forward reads. ZeRO-1/2's forward weights are whole on every rank, assembled from the shares
    (an all-reduce each); ZeRO-3's persistent parameters are gathered again, as its step does."""
    tensors = model_tensors(bare_model(accelerator, model))
    persistent = []
    for name, share in values.items():
        tensor = tensors[name]
        if hasattr(tensor, FROZEN_SHARE) or not tensor.requires_grad:
            raise ValueError(f"{name} is not trained: write_shares writes the trained parameters' shares")
        if hasattr(tensor, "ds_id"):
            if share is not None:
                _write_zero3(tensor, share)
            if tensor.data.numel() == tensor.ds_numel:
                persistent.append(tensor)
        elif hasattr(tensor, "_hp_mapping"):
            whole = torch.zeros(tensor.numel(), dtype=torch.promote_types(tensor.dtype, torch.float32),
                                device=tensor.device)
            if share is not None:
                tensor._hp_mapping.get_hp_fragment().data.copy_(share)
                start = tensor._hp_mapping.lp_fragment_address.start
                whole[start:start + share.numel()] = share.to(whole)
            torch.distributed.all_reduce(whole)  # each value is in one rank's fragment, zeros elsewhere
            tensor.data.copy_(whole.view(tensor.data.shape))
        elif share is not None and hasattr(tensor, "device_mesh") and not _rows(tensor):
            write_value(tensor, share)  # (a tensor-parallel slice: its share is the whole)
        elif share is not None:
            with torch.no_grad():
                _local(tensor).view(-1).copy_(share)
    if persistent:  # freed (their partitions are what was just written), then gathered from them
        persistent[0].partition(persistent)
        persistent[0].all_gather(persistent)


def _write_zero3(tensor: torch.Tensor, partition: torch.Tensor) -> None:
    """A ZeRO-3 parameter's partition on this rank: the forward's (`ds_tensor`) and, trained, the fp32 master's, from
    the values it holds of the whole (the last rank's padding left as it is). DeepSpeed 0.19.8's
    `safe_set_full_fp32_param` reads past the whole where the process count does not divide it: the local one is set."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

    tensor.ds_tensor.data.reshape(-1)[:partition.numel()].copy_(partition)
    if tensor.requires_grad:
        master = safe_get_local_fp32_param(tensor).clone()
        master.reshape(-1)[:partition.numel()] = partition.to(master)
        safe_set_local_fp32_param(tensor, master)


def _local(tensor: torch.Tensor | float) -> torch.Tensor | float:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def shard_like(tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` laid out as `tensor` is: a DTensor's own shard (every rank read the whole: no communication)."""
    if not hasattr(tensor, "device_mesh"):
        return value.to(tensor.device)
    from torch.distributed.tensor import DTensor, distribute_tensor

    shard = distribute_tensor(value.to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None)
    # its own copy: a view would keep the whole tensor alive, on every rank, as long as the optimizer state
    return DTensor.from_local(shard.to_local().clone(), tensor.device_mesh, tensor.placements, run_check=False,
                              shape=shard.shape, stride=shard.stride())
