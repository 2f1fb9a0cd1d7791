"""The tensor format of `model_state/`: every tensor's value and optimizer state, each in the dtype the run holds it
in (a ZeRO master's for what ZeRO trains: fp32; int64, float64, bool, complex as they are), written by each rank as
the pieces it holds under any strategy, and read back whole into any other layout (another strategy or process
count)."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from training.checkpoints.files import TRAINER_STATE, file_sha256
from training.errors import ResumeError
from training.strategy import bare_model
from training.strategy.shares import (
    Share,
    _local,
    model_tensors,
    other_optimizer_state,
    shard_like,
    shares_of,
    stepped_by_zero,
    whole_shape,
    write_value,
    zero3_range,
)
from training.strategy.whole import scalars_gathered_1d

# A piece is (its offset in the flattened whole, values in their own dtype). Optimizer state not shaped like its tensor
# (a step count, Adafactor's factored moments) is kept as the optimizer holds it, a tensor or a number, at offset None.

MODEL_STATE = "model_state"  # rank<N>.safetensors: each rank's pieces of every tensor's value and optimizer state

Piece = tuple[int | None, torch.Tensor | float | int]


@dataclass
class TensorState:
    """One tensor of the checkpoint, whole: its value, the optimizer state shaped like it, and the rest."""

    value: torch.Tensor
    elementwise: dict[str, torch.Tensor] = field(default_factory=dict)  # AdamW's moments
    other: dict[str, torch.Tensor | float | int] = field(default_factory=dict)  # a step count, factored moments


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
    """What this rank writes of `tensor`, per key ("value", then its optimizer state's): its shares (`shares_of`: no
    communication, but for a DTensor split otherwise than by rows), where another rank does not write the same (a
    replicated tensor: rank 0), and the rest of the optimizer state (a step count), by rank 0 or, where ZeRO steps it,
    by every rank holding a share (one count for all). `optimizer`: the base one."""
    shares = shares_of(tensor, optimizer)
    pieces = {key: (share.start, _on_host(share.values)) for key, share in shares.items()
              if rank == 0 or not share.replicated}
    writes_others = bool(shares) if stepped_by_zero(tensor) else rank == 0
    others = other_optimizer_state(tensor, optimizer) if writes_others else {}
    # (copies: ZeRO's step count is one tensor for every parameter, which a safetensors file cannot hold twice)
    return pieces | {key: (None, _on_host(value).clone() if torch.is_tensor(value) else value)
                     for key, value in others.items()}


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A share's values on the host, in their own dtype (never rounded: an int64 counter past 2**24 stays exact)."""
    return own_storage(_local(tensor).detach().cpu())


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied where it is a view into a larger buffer (ZeRO's flat buffers, ZeRO-3's gathered layers), which
    a safetensors file refuses."""
    return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() else tensor


def set_full_state(tensor: torch.Tensor, saved: TensorState, optimizer: torch.optim.Optimizer,
                   torch_states: dict[int, dict]) -> None:
    """Set `tensor` (`write_value`) and its optimizer state from their whole values (`ModelState.whole`), on every
    rank: ZeRO's partitions at once, a torch optimizer's into `torch_states` (by the tensor's id), for
    `load_optimizer_states`."""
    with scalars_gathered_1d([tensor]):
        write_value(tensor, saved.value)
    if stepped_by_zero(tensor):
        if tensor.requires_grad and saved.elementwise:
            _set_zero_state(tensor, saved)
        for stepped in optimizer.state.values() if saved.other else ():  # ZeRO steps flat partitions: one count
            for key, count in saved.other.items():
                if key in stepped:
                    number = count.item() if torch.is_tensor(count) else count
                    stepped[key] = (stepped[key].fill_(number) if torch.is_tensor(stepped[key])
                                    else type(stepped[key])(number))
        return
    if saved.elementwise or saved.other:
        torch_states[id(tensor)] = {key: shard_like(tensor, state) for key, state in saved.elementwise.items()} | \
            saved.other


def _set_zero_state(tensor: torch.Tensor, saved: TensorState) -> None:
    """ZeRO's optimizer state of a parameter it steps (its master: `write_value`). ZeRO-3's from this rank's padded
    partition (DeepSpeed 0.19.8's full setters read past the whole where the process count does not divide it)."""
    from deepspeed.utils import safe_set_full_optimizer_state, safe_set_local_optimizer_state

    if not hasattr(tensor, "ds_id"):
        for key, state in saved.elementwise.items():
            safe_set_full_optimizer_state(tensor, state.reshape(tensor.shape).to(tensor.device), key)
        return
    start, size, held = zero3_range(tensor)
    for key, state in saved.elementwise.items():
        padded = torch.zeros(size, dtype=state.dtype)  # (DeepSpeed casts it to the master's dtype)
        padded[:held] = state.reshape(-1)[start:start + held]
        safe_set_local_optimizer_state(tensor, padded.to(tensor.ds_tensor.device), key)


def load_optimizer_states(optimizer: torch.optim.Optimizer, torch_states: dict[int, dict]) -> None:
    """A torch optimizer's state from `set_full_state`'s, through its `load_state_dict` (devices, steps, and each
    state cast to its parameter's dtype), but a half-precision parameter's state saved wider comes back float32 (as
    Adafactor keeps a bf16 parameter's moments: cast to bf16 they would be rounded)."""
    if not torch_states:
        return
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()
    saved["state"] = {index: torch_states[id(p)] for index, p in enumerate(parameters) if id(p) in torch_states}
    optimizer.load_state_dict(saved)
    for parameter in parameters:
        for key, value in torch_states.get(id(parameter), {}).items():
            loaded = optimizer.state[parameter].get(key)
            if torch.is_tensor(value) and torch.is_tensor(loaded) and loaded.is_floating_point() and \
                    loaded.dtype.itemsize < 4 <= value.dtype.itemsize:
                optimizer.state[parameter][key] = value.to(loaded.device, torch.float32)


WHOLE = "whole"  # the offset of optimizer state kept as the optimizer holds it (`held_pieces`' offset None)
AS_BYTES = (torch.complex128, torch.complex32)  # dtypes safetensors 0.8 cannot hold: written as their bytes (uint8)


def save_model_state(accelerator: Accelerator, model: torch.nn.Module, optimizer, directory: Path,
                     stamp: dict[str, str] | None = None) -> str:
    """Every rank writes the pieces it holds of every tensor and its optimizer state (`held_pieces`: no gathering, so
    as fast as the strategies' own saves) to its file (`write_pieces`). Returns the file's SHA-256."""
    base, rank = base_optimizer(optimizer), accelerator.process_index
    tensors = model_tensors(bare_model(accelerator, model))
    return write_pieces(directory, rank, {name: held_pieces(tensor, base, rank) for name, tensor in tensors.items()},
                        {name: whole_shape(tensor) for name, tensor in tensors.items()}, stamp)


def save_shares(accelerator: Accelerator, directory: Path, shares: dict[str, Share | None],
                shapes: dict[str, list[int]], stamp: dict[str, str] | None = None) -> str:
    """Every rank: its shares (`shares_of`'s layout; None where it holds none) of model-shaped tensors of a part's own
    (parts/ema: an average of the weights) into `directory`, in the format of model_state/, which `load_shares` reads
    back under any strategy and process count. `shapes`: each tensor's whole shape. Returns the file's SHA-256."""
    rank = accelerator.process_index
    pieces = {name: {"value": (share.start, _on_host(share.values))} for name, share in shares.items()
              if share is not None and (rank == 0 or not share.replicated)}
    return write_pieces(directory, rank, pieces, shapes, stamp)


def load_shares(checkpoint: Path, folder: str, layout: dict[str, Share | None],
                shapes: dict[str, list[int]]) -> dict[str, torch.Tensor | None]:
    """Every rank: what `save_shares` wrote into `checkpoint`/`folder`, whatever strategy and process count wrote it,
    cut to this rank's shares (`layout`: this rank's share of each tensor, as `shares_of` lays it out; None where it
    holds none; `shapes`: each tensor's whole shape). Refused in one line (ResumeError) where the names or shapes
    differ."""
    with contextlib.ExitStack() as files:
        saved = ModelState(checkpoint, files, folder)
        if sorted(saved.shapes) != sorted(layout):
            missing = sorted(set(layout) - set(saved.shapes)) or sorted(set(saved.shapes) - set(layout))
            raise ResumeError(f"{checkpoint / folder} holds other tensors than this run keeps ({missing[0]} is in one "
                              "only); resume with the model and settings it was saved with")
        if changed := [name for name in layout if saved.shapes[name] != list(shapes[name])]:
            raise ResumeError(f"{checkpoint / folder} holds {changed[0]} of shape {saved.shapes[changed[0]]}, this run's "
                              f"is {list(shapes[changed[0]])}; resume with the model it was saved with")
        loaded = {}
        for name, share in layout.items():
            if share is None:
                loaded[name] = None
                continue
            whole = saved.whole(name).value.reshape(-1)
            loaded[name] = whole[share.start:share.start + share.values.numel()].to(share.values)
        return loaded


def write_pieces(directory: Path, rank: int, pieces: dict[str, dict[str, Piece]], shapes: dict[str, list[int]],
                 stamp: dict[str, str] | None) -> str:
    """One rank's file of the tensor format, `directory`/rank<N>.safetensors: its pieces of each tensor (by key:
    "value", an optimizer state's), with the tensors' whole shapes and the dtypes of its pieces; state that is a
    number (a step count) goes into the file's metadata, as JSON keeps it, and so does `stamp` (the run and step the
    file belongs to). Returns the file's SHA-256."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors, numbers = {}, {}
    for name, held in pieces.items():
        for key, (start, piece) in held.items():
            if torch.is_tensor(piece):
                tensors[f"{name}|{key}|{WHOLE if start is None else start}"] = piece
            else:
                numbers[f"{name}|{key}"] = piece
    metadata = {"shapes": json.dumps(shapes), "numbers": json.dumps(numbers), **(stamp or {}),
                "dtypes": json.dumps({key.rsplit("|", 1)[0]: str(piece.dtype).removeprefix("torch.")
                                      for key, piece in tensors.items()})}
    tensors = {key: piece.view(torch.uint8) if piece.dtype in AS_BYTES else piece for key, piece in tensors.items()}
    save_file(tensors, path := directory / f"rank{rank}.safetensors", metadata=metadata)
    return file_sha256(path)  # (read back from the page cache: each rank its own file, in parallel)


def tensor_records(directory: Path) -> dict[str, dict]:
    """Every tensor's whole shape and the dtype of its value, from the headers of `save_model_state`'s files (the
    manifest's record; nothing where a part's runner saved otherwise)."""
    records = {}
    for path in sorted(directory.glob("rank*.safetensors")):
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata()
        dtypes = json.loads(metadata.get("dtypes", "{}"))
        for name, shape in json.loads(metadata["shapes"]).items():
            records.setdefault(name, {"shape": shape})
            if dtype := dtypes.get(f"{name}|value"):
                records[name]["dtype"] = dtype
    return records


class ModelState:
    """A checkpoint's `save_model_state` files, one per rank that saved it, read lazily: one whole tensor (and its
    optimizer state) assembled at a time, in the dtype its pieces were saved in."""

    def __init__(self, checkpoint: Path, files: contextlib.ExitStack, folder: str = MODEL_STATE) -> None:
        self.directory, self.shapes, self.pieces, self.numbers = checkpoint / folder, {}, {}, {}
        processes = json.loads((checkpoint / TRAINER_STATE).read_text())["num_processes"]
        for rank in range(processes):
            path = self.directory / f"rank{rank}.safetensors"
            try:
                handle = files.enter_context(safe_open(path, "pt"))
                metadata = handle.metadata()
                self.shapes |= json.loads(metadata["shapes"])
                numbers = json.loads(metadata.get("numbers", "{}"))  # (checkpoints before 2026-11-28 have none)
            except FileNotFoundError:
                raise ResumeError(f"{path} is missing (the checkpoint was saved by {processes} processes); resume "
                                  "an earlier checkpoint") from None
            except (SafetensorError, OSError, KeyError, TypeError, ValueError) as error:
                raise ResumeError(f"{path} is damaged ({str(error).splitlines()[0]}); resume an earlier "
                                  "checkpoint") from None
            for key, number in numbers.items():
                name, kind = key.rsplit("|", 1)
                self.numbers.setdefault(name, {})[kind] = number
            dtypes = json.loads(metadata.get("dtypes", "{}"))  # (checkpoints before 2026-12-04: as stored)
            for key in handle.keys():
                name, kind, start = key.rsplit("|", 2)
                dtype = getattr(torch, dtypes.get(f"{name}|{kind}", ""), None)
                self.pieces.setdefault(name, {}).setdefault(kind, []).append((start, path, handle, key, dtype))

    def whole(self, name: str) -> TensorState:
        """`name`'s value and optimizer state, each assembled whole from the ranks' pieces, in their saved dtype."""
        state = TensorState(value=None, other=dict(self.numbers.get(name, {})))
        for kind, pieces in self.pieces.get(name, {}).items():
            if pieces[0][0] == WHOLE or kind == "step":  # the same on every rank that wrote it
                kept = self._read(*pieces[0][1:])  # (before 2026-11-28 a step count was a piece of one value)
                state.other[kind] = kept if pieces[0][0] == WHOLE else kept[0]
                continue
            flat, covered = None, 0
            for start, *where in pieces:
                piece = self._read(*where)
                if flat is None:
                    flat = torch.empty(math.prod(self.shapes[name]), dtype=piece.dtype)
                if piece.dtype != flat.dtype:
                    raise ResumeError(f"{where[0]} holds {name} ({kind}) in {piece.dtype}, another rank's file in "
                                      f"{flat.dtype}: the files are of different checkpoints; resume an earlier one")
                flat[int(start):int(start) + piece.numel()], covered = piece, covered + piece.numel()
            if covered != flat.numel():
                raise ResumeError(f"{self.directory} holds {covered} of {name}'s {flat.numel()} values ({kind}): a rank's "
                                  "file is damaged; resume an earlier checkpoint")
            if kind == "value":
                state.value = flat.view(self.shapes[name])
            else:
                state.elementwise[kind] = flat.view(self.shapes[name])
        if state.value is None:
            raise ResumeError(f"{self.directory} holds no values of {name}: a rank's file is damaged; resume an "
                              "earlier checkpoint")
        return state

    @staticmethod
    def _read(path: Path, handle, key: str, dtype: torch.dtype | None) -> torch.Tensor:
        """One piece, in the dtype its file records (`AS_BYTES` ones were written as their bytes)."""
        try:
            piece = handle.get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise ResumeError(f"{path} is damaged ({str(error).splitlines()[0]}); resume an earlier checkpoint") from None
        return piece.view(dtype) if dtype in AS_BYTES and piece.dtype == torch.uint8 else piece


def load_model_state(accelerator: Accelerator, model: torch.nn.Module, base: torch.optim.Optimizer | None,
                     checkpoint: Path) -> None:
    """The checkpoint's `save_model_state` tensors into this run's model and optimizer (`base`: the one inside the
    wrappers, `base_optimizer`; None: the weights alone), however they are laid out."""
    tensors = model_tensors(bare_model(accelerator, model))
    with contextlib.ExitStack() as files:
        saved = ModelState(checkpoint, files)
        if sorted(saved.shapes) != sorted(tensors):
            differences = [f"{len(names)} {whose} ({', '.join(names[:2])}...)" for names, whose in (
                (sorted(set(saved.shapes) - set(tensors)), "of its tensors are not in this model"),
                (sorted(set(tensors) - set(saved.shapes)), "of this model's tensors are not in it")) if names]
            raise ResumeError(f"{checkpoint} holds another model: {'; '.join(differences)}; resume with the model "
                              "it was trained with (--model_config, --config_overrides, --model_name_or_path)")
        torch_states = {}
        for name, tensor in tensors.items():
            if saved.shapes[name] != (shape := whole_shape(tensor)):
                raise ResumeError(f"{checkpoint} holds {name} of shape {saved.shapes[name]}, this model's is "
                                  f"{shape}; resume with the model it was trained with")
            whole = saved.whole(name)
            set_full_state(tensor, whole if base is not None else TensorState(whole.value), base, torch_states)
        if base is not None:
            load_optimizer_states(base, torch_states)


def set_next_rate(optimizer: torch.optim.Optimizer, scheduler) -> None:
    """The learning rate of the step to come (which an optimizer's own state dict would have held), from this run's
    schedule at the restored step: a resume that raised --max_steps follows the stretched schedule from its first step."""
    if hasattr(scheduler, "lr_lambdas"):  # transformers' schedules: a factor of the step
        rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    else:
        rates = scheduler.get_last_lr()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = list(rates)  # what get_last_lr() reports (the checkpoint's otherwise, at another rate)
