"""Load checkpoints without running code from them.

Unpickling can run arbitrary code, and checkpoints come from shared filesystems and other
people. Everything train.py loads that is not safetensors is unpickled against an allow-list:
- `torch.load` runs with `weights_only=True`: accelerate asks for it already, DeepSpeed asks
  for full unpickling, so it is forced (`TORCH_FORCE_WEIGHTS_ONLY_LOAD`), with the four plain
  data types DeepSpeed's checkpoints hold allowed by name;
- FSDP2's distributed-checkpoint metadata (`.metadata`), which torch reads with plain
  `pickle`, is first read here with an unpickler that admits only DCP's metadata types;
- either way, `builtins.getattr` (how some Python releases pickle an enum's member) only
  looks up a member of an enum the list allows (`enum_members_of`).
A refused file raises `pickle.UnpicklingError`.
"""

from __future__ import annotations

import enum
import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # read by torch.load at every call
DCP_METADATA = ".metadata"
# module -> names a DCP metadata file may refer to (None: any class of that module)
_DCP_ALLOWED: dict[str, set[str] | None] = {
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", *(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def enum_members_of(allowed: Callable[[type], bool]) -> Callable[[type, str], enum.Enum]:
    """What unpickling `builtins.getattr` may do: some Python releases (3.11.2, not 3.11.7) pickle an enum's
    member as `getattr(enum, name)`. Only that, for the enums `allowed` admits: a general getattr would reach
    any attribute of anything the allow-list lets in."""

    def enum_member(cls: type, name: str) -> enum.Enum:
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and allowed(cls) and isinstance(name, str)):
            raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not allowed in a checkpoint")
        return cls[name]

    return enum_member


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return enum_members_of(lambda cls: _DCP_ALLOWED.get(cls.__module__, set()) is None)
        allowed = _DCP_ALLOWED.get(module, set())
        if allowed is not None and name not in allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        found = super().find_class(module, name)
        if allowed is None and not isinstance(found, type):
            raise pickle.UnpicklingError(f"{module}.{name} is not a metadata type")
        return found


def check_dcp_metadata(checkpoint: Path) -> None:
    """Read every DCP `.metadata` under `checkpoint` with the allow-list (torch then reads it with plain pickle)."""
    for metadata in checkpoint.rglob(DCP_METADATA):
        with metadata.open("rb") as stream:
            _MetadataUnpickler(stream).load()


def _deepspeed_checkpoint_types() -> list[type | tuple]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address,
            (enum_members_of(lambda cls: cls is ZeroStageEnum), "builtins.getattr")]


@contextmanager
def safe_unpickling(checkpoint: Path, deepspeed: bool) -> Iterator[None]:
    """Check `checkpoint`'s DCP metadata, then force weights-only `torch.load` inside the block."""
    check_dcp_metadata(checkpoint)
    previous_env, previous_globals = os.environ.get(FORCE_WEIGHTS_ONLY), torch.serialization.get_safe_globals()
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    if deepspeed:
        torch.serialization.add_safe_globals(_deepspeed_checkpoint_types())
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(previous_globals)
        if previous_env is None:
            del os.environ[FORCE_WEIGHTS_ONLY]
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = previous_env
