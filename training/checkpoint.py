"""Resumable checkpoints and `final/`. A checkpoint (`checkpoints/step_N`) holds the model and optimizer state in one
format for every strategy and process count (`model_state/`), accelerate's `save_state` of the rest (schedule, RNG,
data position, the parts' objects) and `trainer_state.json`. Each is saved to `step_N.tmp` and renamed once every rank
is done (a killed save never counts); multi-node needs a shared filesystem."""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel
from accelerate.utils import broadcast_object_list
from safetensors import safe_open
from safetensors.torch import save_file

from training.batchnorm import average_running_statistics
from training.errors import ArgumentError, ResumeError
from training.parts import ModelRunner, filled
from training.strategy_adapters import (bare_model, base_optimizer, held_pieces, load_optimizer_states, model_tensors,
                                        own_class_while_saving, set_full_state, whole_shape)

TRAINER_STATE = "trainer_state.json"
PLAIN_MODEL = "model.json"  # in final/: how to rebuild a plain nn.Module (its class and constructor arguments)
MODEL_STATE = "model_state"  # rank<N>.safetensors: each rank's pieces of every tensor's fp32 value and optimizer state
DEEPSPEED_DIR = "pytorch_model"  # what accelerate's save_state wrote for a DeepSpeed engine (before model_state/)
STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    completed_steps: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0  # optimizer steps taken in `epoch`: the data position to skip to
    global_batch: int = 0  # sequences per optimizer step; resuming needs the same
    num_processes: int = 1  # that saved the checkpoint
    strategy: str = ""  # that saved it, as its config is named (deepspeed_zero2, fsdp...)
    layout: dict[str, int] = field(default_factory=dict)  # how parts cut the model (pipeline stages), each saved apart
    per_device_train_batch_size: int = 0  # the micro-batch that ran (0: not recorded, before --auto_find_batch_size)
    gradient_accumulation_steps: int = 0


def checkpoints_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / TRAINER_STATE).is_file()]
    return [path for _, path in sorted(found)]


RUN_OUTPUTS = ("checkpoints", "final", "runs", "metrics.jsonl", "summary.json", "report.png")


def check_output_dir(output_dir: str, resume: str | None, overwrite: bool, inputs: dict[str, str | None]) -> None:
    """Before any process group: resume/overwrite flags agree, overwriting deletes no input (flag -> path), writable."""
    if resume and resume != "latest":
        try:
            require_complete_checkpoint(Path(resume))
        except FileNotFoundError as error:
            raise ArgumentError(str(error)) from None
        if newer := [p.name for p in newer_checkpoints(Path(resume), output_dir)]:
            raise ArgumentError(f"{resume} is older than {newer} in the same output_dir, which 'latest' would pick "
                                "after a restart; move those elsewhere first, or resume into another --output_dir")
    if resume and overwrite:
        raise ArgumentError("--overwrite_output_dir starts afresh and --resume_from_checkpoint continues: give one")
    if not resume and not overwrite and (complete_checkpoints(output_dir) or (Path(output_dir) / "final").exists()):
        raise ArgumentError(
            f"{output_dir} already holds a run (checkpoints or final/); continue it with --resume_from_checkpoint "
            "latest, start afresh with --overwrite_output_dir, or choose another --output_dir")
    deleted = [(Path(output_dir) / name).resolve() for name in RUN_OUTPUTS] if overwrite else []
    for flag, path in inputs.items():
        if path and (inside := next((d for d in deleted if Path(path).resolve().is_relative_to(d)), None)):
            raise ArgumentError(f"--overwrite_output_dir would delete {inside}, which --{flag} {path} reads; nothing "
                                "was deleted: give this run another --output_dir")
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".write-test-"):
            pass
    except OSError as error:
        raise ArgumentError(f"cannot write to --output_dir {output_dir} ({error.strerror}); choose a writable directory") from None


def clear_previous_run(output_dir: str) -> None:
    """--overwrite_output_dir: delete what an earlier run left in `output_dir` (main process only)."""
    for name in RUN_OUTPUTS:
        path = Path(output_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def resolve_resume_path(resume_from_checkpoint: str | None, output_dir: str,
                        accelerator: Accelerator | None = None) -> Path | None:
    """`latest`: the newest complete checkpoint or None, broadcast so all ranks agree while a save is renamed."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint == "latest":
        found = complete_checkpoints(output_dir)
        choice = [str(found[-1]) if found else None]
        if accelerator is not None:
            broadcast_object_list(choice)
        return Path(choice[0]) if choice[0] else None
    return require_complete_checkpoint(Path(resume_from_checkpoint))


def newer_checkpoints(path: Path, output_dir: str) -> list[Path]:
    """Complete checkpoints of `output_dir` past `path`, when `path` is one of its checkpoints."""
    match = STEP_DIR.match(path.name)
    if not match or path.resolve().parent != checkpoints_root(output_dir).resolve():
        return []
    return [p for p in complete_checkpoints(output_dir) if int(STEP_DIR.match(p.name).group(1)) > int(match.group(1))]


def require_complete_checkpoint(path: Path) -> Path:
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path} (missing {TRAINER_STATE}); check --resume_from_checkpoint")
    return path


def save_checkpoint(accelerator: Accelerator, model: torch.nn.Module, optimizer, output_dir: str, state: TrainerState,
                    save_total_limit: int | None) -> Path:
    """On every rank (sharded saves need all); BatchNorm stats averaged first so a resume matches an unbroken run."""
    average_running_statistics(model, accelerator)
    path = checkpoints_root(output_dir) / f"step_{state.completed_steps}"
    staging = path.with_name(path.name + ".tmp")
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)  # left by a save that was killed
    accelerator.wait_for_everyone()
    with without_model_and_optimizer(accelerator, model):
        accelerator.save_state(str(staging))
    if not isinstance(model, ModelRunner):  # (a part's model saves itself through save_state's hooks: pipeline stages)
        save_model_state(accelerator, model, optimizer, staging / MODEL_STATE)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (staging / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=2))
        if path.exists():  # the same step saved before, e.g. by the run this one resumed
            shutil.rmtree(path)
        staging.rename(path)
        if save_total_limit:
            rotate_checkpoints(output_dir, path, save_total_limit)
    accelerator.wait_for_everyone()
    return path


@contextlib.contextmanager
def without_model_and_optimizer(accelerator: Accelerator, model) -> Iterator[None]:
    """accelerate's `save_state`/`load_state` of all but a `model` whose state is in `MODEL_STATE` (accelerate 1.15
    has no switch: its lists are emptied meanwhile). None: all of it (a part's model, a checkpoint before model_state/)."""
    kept = accelerator._models, accelerator._optimizers
    if model is not None and not isinstance(model, ModelRunner):
        accelerator._models, accelerator._optimizers = [], []
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = kept


def save_model_state(accelerator: Accelerator, model: torch.nn.Module, optimizer, directory: Path) -> None:
    """Every rank writes the pieces it holds of every tensor and its optimizer state (`held_pieces`: no gathering, so
    as fast as the strategies' own saves) to one file, with the tensors' whole shapes."""
    directory.mkdir(parents=True, exist_ok=True)
    base, rank, pieces, shapes = base_optimizer(optimizer), accelerator.process_index, {}, {}
    for name, tensor in model_tensors(bare_model(accelerator, model)).items():
        shapes[name] = whole_shape(tensor)
        for key, (start, piece) in held_pieces(tensor, base, rank).items():
            pieces[f"{name}|{key}|{start}"] = piece
    save_file(pieces, directory / f"rank{rank}.safetensors", metadata={"shapes": json.dumps(shapes)})


class ModelState:
    """`save_model_state`'s files, read lazily: one whole tensor (or its optimizer state) assembled at a time."""

    def __init__(self, directory: Path, files: contextlib.ExitStack) -> None:
        self.directory, self.shapes, self.pieces = directory, {}, {}
        for path in sorted(directory.glob("rank*.safetensors")):
            handle = files.enter_context(safe_open(path, "pt"))
            self.shapes |= json.loads(handle.metadata()["shapes"])
            for key in handle.keys():
                name, kind, start = key.rsplit("|", 2)
                self.pieces.setdefault(name, {}).setdefault(kind, []).append((int(start), handle, key))

    def whole(self, name: str) -> dict[str, torch.Tensor]:
        """`name`'s fp32 value and optimizer state, each assembled whole from the ranks' pieces."""
        state = {}
        for kind, pieces in self.pieces.get(name, {}).items():
            if kind == "step":  # the same count, written by every rank that holds a piece
                state[kind] = pieces[0][1].get_tensor(pieces[0][2])[0]
                continue
            flat, covered = torch.empty(math.prod(self.shapes[name])), 0
            for start, handle, key in pieces:
                piece = handle.get_tensor(key)
                flat[start:start + piece.numel()], covered = piece, covered + piece.numel()
            if covered != flat.numel():
                raise ResumeError(f"{self.directory} holds {covered} of {name}'s {flat.numel()} values ({kind}): a rank's "
                                  "file is missing or damaged; resume an earlier checkpoint")
            state[kind] = flat.view(self.shapes[name])
        return state


def load_model_state(accelerator: Accelerator, model: torch.nn.Module, base: torch.optim.Optimizer,
                     directory: Path) -> None:
    """`save_model_state`'s tensors into this run's model and optimizer (`base`: the one inside the wrappers,
    `base_optimizer`), however they are laid out."""
    tensors = model_tensors(bare_model(accelerator, model))
    with contextlib.ExitStack() as files:
        saved = ModelState(directory, files)
        if sorted(saved.shapes) != sorted(tensors):
            differences = [f"{len(names)} {whose} ({', '.join(names[:2])}...)" for names, whose in (
                (sorted(set(saved.shapes) - set(tensors)), "of its tensors are not in this model"),
                (sorted(set(tensors) - set(saved.shapes)), "of this model's tensors are not in it")) if names]
            raise ResumeError(f"{directory.parent} holds another model: {'; '.join(differences)}; resume with the model "
                              "it was trained with (--model_config, --config_overrides, --model_name_or_path)")
        torch_states = {}
        for name, tensor in tensors.items():
            if saved.shapes[name] != (shape := whole_shape(tensor)):
                raise ResumeError(f"{directory.parent} holds {name} of shape {saved.shapes[name]}, this model's is "
                                  f"{shape}; resume with the model it was trained with")
            set_full_state(tensor, saved.whole(name), base, torch_states)
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


def rotate_checkpoints(output_dir: str, newest: Path, limit: int) -> None:
    """Keep `newest` (even below higher steps left by a resumed run) and the `limit - 1` highest others."""
    others = [path for path in complete_checkpoints(output_dir) if path != newest]
    for old in others[: max(len(others) - (limit - 1), 0)]:
        shutil.rmtree(old)


def load_checkpoint(accelerator: Accelerator, path: Path, global_batch: int, max_steps: int,
                    layout: dict[str, int] | None = None, model=None, optimizer=None, scheduler=None) -> TrainerState:
    """Check on every rank that `path` continues this run exactly, then restore it."""
    try:
        saved = json.loads((path / TRAINER_STATE).read_text())
        if (stages := saved.pop("pipeline_stages", 1)) > 1:  # how checkpoints before 2026-11-27 recorded a pipeline
            saved["layout"] = {"pipeline_stages": stages}
        state = TrainerState(**saved)
    except (TypeError, ValueError):
        raise ResumeError(f"{path / TRAINER_STATE} was not written by this version of train.py; cannot resume it")
    if state.completed_steps >= max_steps:
        raise ResumeError(f"{path} is at step {state.completed_steps} and --max_steps is {max_steps}: nothing left "
                          "to train; raise --max_steps (the learning-rate schedule then stretches to the new length)")
    if state.global_batch != global_batch:
        raise ResumeError(
            f"{path} was trained with a global batch of {state.global_batch}, this run has {global_batch}; "
            "keep per_device_train_batch_size x processes x gradient_accumulation_steps the same to resume")
    if state.layout != (layout or {}):
        def shown(cut: dict[str, int]) -> str:
            return ", ".join(f"{key} {value}" for key, value in sorted(cut.items())) or "one whole model per process"

        raise ResumeError(f"{path} holds a model laid out as {shown(state.layout)} and this run lays it out as "
                          f"{shown(layout or {})}; resume with the flags that laid it out so, or start a new run from "
                          "that run's final/ with --model_name_or_path (the optimizer state is not carried over)")
    if (path / DEEPSPEED_DIR).is_dir() and state.num_processes != accelerator.num_processes:
        raise ResumeError(
            f"{path} is a DeepSpeed checkpoint of {state.num_processes} processes; DeepSpeed cannot resume it on "
            f"{accelerator.num_processes}. Resume on {state.num_processes} processes, or convert it to full weights with "
            f"`python {path}/zero_to_fp32.py {path} <out_dir> --safe_serialization`, copy config.json and the "
            "tokenizer files from final/ into <out_dir>, and start a new run from --model_name_or_path <out_dir> "
            "(the optimizer state is not carried over)")
    try:
        with contextlib.ExitStack() as loading:
            for hook in filled("loading_checkpoint"):  # the parts' (parts/safe_loading: unpickling on an allow-list)
                loading.enter_context(hook(path, (path / DEEPSPEED_DIR).is_dir()))
            with without_model_and_optimizer(accelerator, model if (path / MODEL_STATE).is_dir() else None):
                accelerator.load_state(str(path))
    except pickle.UnpicklingError:
        raise ResumeError(f"{path} holds pickled objects that are not plain tensors or data; refused to load them, "
                          "as unpickling can run code. Resume only checkpoints this template wrote") from None
    if (path / MODEL_STATE).is_dir():
        base = base_optimizer(optimizer)  # (made and linked once: ZeRO's state, training/strategy_adapters.py)
        load_model_state(accelerator, model, base, path / MODEL_STATE)
        set_next_rate(base, getattr(scheduler, "scheduler", scheduler))
    # Resumes start at an optimizer-step boundary: the restored micro-step counter (when gradients sync) is stale if
    # accumulation or process count changed, or 0 on some ranks only (a missing rank file); mismatched syncs hang.
    accelerator.step = 0
    return state


def export_final(accelerator: Accelerator, model, task, output_dir: str) -> Path:
    """Whole model as safetensors, processor and config (plain modules: `model.json`); every rank, to gather shards."""
    final_dir = Path(output_dir) / "final"
    average_running_statistics(model, accelerator)
    if isinstance(model, ModelRunner):  # a part's model that exports itself (pipeline stages: merged on rank 0)
        return model.export(accelerator, task.processor, final_dir)
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
