"""One save (`save_checkpoint`) and the export of `final/` (`export_final`)."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from huggingface_hub import save_torch_state_dict
from transformers import PreTrainedModel

from training.batchnorm import average_running_statistics
from training.checkpoints.files import (
    PLAIN_MODEL,
    TRAINER_STATE,
    TrainerState,
    checkpoint_files,
    checkpoints_root,
    file_sha256,
    rotate_checkpoints,
    write_manifest,
)
from training.checkpoints.tensors import MODEL_STATE, own_storage, tensor_records
from training.strategy.shares import model_tensors, whole_shape
from training.errors import ModelError
from training.parts import CheckpointFiles, parts
from training.strategy.adapters import own_class_while_saving
from training.strategy.whole import scalars_gathered_1d

if TYPE_CHECKING:
    from training.runner import ModelRunner


def save_checkpoint(accelerator: Accelerator, runner: ModelRunner, model: torch.nn.Module, optimizer, output_dir: str,
                    state: TrainerState, save_total_limit: int | None) -> Path:
    """On every rank (sharded saves need all); BatchNorm stats averaged first so a resume matches an unbroken run.
    accelerate saves the schedule, generators and data position; the runner the model and optimizer state; the parts
    their own files, the main process trainer_state.json; every file is hashed, the main process writes the manifest and
    renames the directory."""
    average_running_statistics(model, accelerator)
    path = checkpoints_root(output_dir) / f"step_{state.completed_steps}"
    staging = path.with_name(path.name + ".tmp")
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)  # left by a save that was killed
    accelerator.wait_for_everyone()
    with without_model_and_optimizer(accelerator):
        accelerator.save_state(str(staging))
    stamp = {"run_id": state.run_id, "step": str(state.completed_steps)}  # what the runner's files say they are
    hashed = runner.save(model, optimizer, staging, stamp) or {}
    parts().save_state(CheckpointFiles(accelerator, staging, stamp))  # the parts' own (a stream's position, PowerSGD's)
    if accelerator.is_main_process:
        (staging / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=2))
    accelerator.wait_for_everyone()
    sha256 = hash_checkpoint(accelerator, staging, hashed)
    if accelerator.is_main_process:
        write_manifest(staging, state.run_id, state.completed_steps, sha256, tensor_records(staging / MODEL_STATE))
        if path.is_symlink():  # a link put there by hand: replaced, what it points to kept
            path.unlink()
        elif path.exists():  # the same step saved before, e.g. by the run this one resumed
            shutil.rmtree(path)
        staging.rename(path)
        if save_total_limit:
            rotate_checkpoints(output_dir, path, save_total_limit)
    accelerator.wait_for_everyone()
    return path


def hash_checkpoint(accelerator: Accelerator, checkpoint: Path, hashed: dict[str, str]) -> dict[str, str]:
    """Every file's SHA-256, by relative path, on every rank: what the ranks hashed as they wrote (`hashed`: the
    runner's files), and the rest (accelerate's, the parts', trainer_state.json) shared out, each rank hashing its
    share in parallel (of the main process's list: a shared filesystem may show the others a late one)."""
    hashed = {name: sha for share in gather_object([hashed]) for name, sha in share.items()}
    listed = broadcast_object_list([checkpoint_files(checkpoint) if accelerator.is_main_process else None])[0]
    rest = [name for name in listed if name not in hashed]
    mine = {name: file_sha256(checkpoint / name) for name in rest[accelerator.process_index::accelerator.num_processes]}
    return hashed | {name: sha for share in gather_object([mine]) for name, sha in share.items()}


@contextlib.contextmanager
def without_model_and_optimizer(accelerator: Accelerator, emptied: bool = True) -> Iterator[None]:
    """accelerate's `save_state`/`load_state` of all but the model and optimizer, whose state the runner saves
    (accelerate 1.15 has no switch: its lists are emptied meanwhile). `emptied` False: all of it (a checkpoint
    written before model_state/)."""
    kept = accelerator._models, accelerator._optimizers
    if emptied:
        accelerator._models, accelerator._optimizers = [], []
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = kept


def export_final(accelerator: Accelerator, runner: ModelRunner, model, task, output_dir: str) -> Path:
    """`final/`, written by the runner on every rank (to gather shards), BatchNorm statistics averaged first."""
    average_running_statistics(model, accelerator)
    return runner.export(model, task, Path(output_dir) / "final")


def export_whole_model(accelerator: Accelerator, model, task, final_dir: Path) -> Path:
    """Whole model as safetensors, processor and config (plain modules: `model.json`); every rank, to gather shards.
    The same tensors under every strategy (`whole_state_dict`)."""
    # unwrap_model keeps --torch_compile's wrapper: weights saved as `_orig_mod.*` load as a random model.
    model = getattr(model, "_orig_mod", model)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = whole_state_dict(accelerator, model, unwrapped)
    with own_class_while_saving(unwrapped):
        if not (isinstance(unwrapped, PreTrainedModel) or hasattr(unwrapped, "peft_config")):  # a plain nn.Module
            if accelerator.is_main_process:  # model.safetensors (or shards of 10 GB and their index)
                final_dir.mkdir(parents=True, exist_ok=True)
                save_torch_state_dict(state_dict, final_dir, max_shard_size="10GB")
                rebuild = {"class": f"{type(unwrapped).__module__}:{type(unwrapped).__qualname__}",
                           "kwargs": task.model_kwargs or {}}
                (final_dir / PLAIN_MODEL).write_text(json.dumps(rebuild, indent=2) + "\n")
        else:  # a peft model saves its adapter alone (peft's format), taken from the gathered state dict
            unwrapped.save_pretrained(final_dir, is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save, state_dict=state_dict)
    if accelerator.is_main_process and task.processor is not None:
        task.processor.save_pretrained(final_dir)
    accelerator.wait_for_everyone()
    return final_dir


def whole_state_dict(accelerator: Accelerator, model, unwrapped: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole tensors on the main process (every rank gathers), named and shaped as the model declares
    them whatever the strategy: a tied weight once, by its first name (FSDP2 and ZeRO-1/2 gathered a copy of
    `lm_head.weight` that ZeRO-3 left out), a 0-dim parameter 0-dim."""
    declared = {name: whole_shape(tensor) for name, tensor in model_tensors(unwrapped).items()}
    with scalars_gathered_1d(unwrapped.parameters()):
        gathered = accelerator.get_state_dict(model) or {}
    if accelerator.is_main_process and (missing := [name for name in declared if name not in gathered]):
        raise ModelError(f"the gathered model lacks {', '.join(missing[:3])} ({len(missing)} of its {len(declared)} "
                         "tensors): final/ would be incomplete, and was not written")
    return {name: own_storage(gathered[name].reshape(shape)) for name, shape in declared.items() if name in gathered}


def load_plain_model(final_dir: str | Path) -> torch.nn.Module:
    """Rebuild a plain `nn.Module` from `final/`; its class is imported from where you run."""
    import importlib

    from accelerate.utils import load_checkpoint_in_model

    rebuild = json.loads((Path(final_dir) / PLAIN_MODEL).read_text())
    module, name = rebuild["class"].split(":")
    model = getattr(importlib.import_module(module), name)(**rebuild["kwargs"])
    load_checkpoint_in_model(model, str(final_dir), strict=True)  # model.safetensors, or shards and their index
    return model
