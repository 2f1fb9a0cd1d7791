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
from transformers import PreTrainedModel

from training.batchnorm import average_running_statistics
from training.checkpoints.files import (
    PLAIN_MODEL,
    TRAINER_STATE,
    TrainerState,
    checkpoints_root,
    rotate_checkpoints,
    write_manifest,
)
from training.parts import CheckpointFiles, parts
from training.strategy.adapters import own_class_while_saving

if TYPE_CHECKING:
    from training.runner import ModelRunner


def save_checkpoint(accelerator: Accelerator, runner: ModelRunner, model: torch.nn.Module, optimizer, output_dir: str,
                    state: TrainerState, save_total_limit: int | None) -> Path:
    """On every rank (sharded saves need all); BatchNorm stats averaged first so a resume matches an unbroken run.
    accelerate saves the schedule, generators and data position; the runner the model and optimizer state; the parts
    their own files; then the main process writes the manifest and trainer_state.json and renames the directory."""
    average_running_statistics(model, accelerator)
    path = checkpoints_root(output_dir) / f"step_{state.completed_steps}"
    staging = path.with_name(path.name + ".tmp")
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)  # left by a save that was killed
    accelerator.wait_for_everyone()
    with without_model_and_optimizer(accelerator):
        accelerator.save_state(str(staging))
    runner.save(model, optimizer, staging)
    parts().save_state(CheckpointFiles(accelerator, staging))  # the parts' own (a stream's position, PowerSGD's)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_manifest(staging)
        (staging / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=2))
        if path.exists():  # the same step saved before, e.g. by the run this one resumed
            shutil.rmtree(path)
        staging.rename(path)
        if save_total_limit:
            rotate_checkpoints(output_dir, path, save_total_limit)
    accelerator.wait_for_everyone()
    return path


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
    """Whole model as safetensors, processor and config (plain modules: `model.json`); every rank, to gather shards."""
    # unwrap_model keeps --torch_compile's wrapper: weights saved as `_orig_mod.*` load as a random model.
    model = getattr(model, "_orig_mod", model)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    with own_class_while_saving(unwrapped):
        if not (isinstance(unwrapped, PreTrainedModel) or hasattr(unwrapped, "peft_config")):  # a plain nn.Module
            accelerator.save_model(model, final_dir)  # model.safetensors (or shards of 10 GB and their index)
            if accelerator.is_main_process:
                rebuild = {"class": f"{type(unwrapped).__module__}:{type(unwrapped).__qualname__}",
                           "kwargs": task.model_kwargs or {}}
                (final_dir / PLAIN_MODEL).write_text(json.dumps(rebuild, indent=2) + "\n")
        else:  # a peft model saves its adapter alone (peft's format), taken from the gathered state dict
            state_dict = accelerator.get_state_dict(model)
            unwrapped.save_pretrained(final_dir, is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save, state_dict=state_dict)
    if accelerator.is_main_process and task.processor is not None:
        task.processor.save_pretrained(final_dir)
    accelerator.wait_for_everyone()
    return final_dir


def load_plain_model(final_dir: str | Path) -> torch.nn.Module:
    """Rebuild a plain `nn.Module` from `final/`; its class is imported from where you run."""
    import importlib

    from accelerate.utils import load_checkpoint_in_model

    rebuild = json.loads((Path(final_dir) / PLAIN_MODEL).read_text())
    module, name = rebuild["class"].split(":")
    model = getattr(importlib.import_module(module), name)(**rebuild["kwargs"])
    load_checkpoint_in_model(model, str(final_dir), strict=True)  # model.safetensors, or shards and their index
    return model
