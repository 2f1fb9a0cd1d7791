"""Resumable checkpoints and `final/`. A checkpoint (`checkpoints/step_N`) holds the model and optimizer state in one
format for every strategy and process count (`model_state/`), accelerate's `save_state` of the rest (schedule, RNG,
data position), the parts' own files (`Part.save_state`: a stream's position, PowerSGD's state), `manifest.json` (every file and its size, checked before a resume) and
`trainer_state.json`. Each is saved to `step_N.tmp` and renamed once every rank is done (a killed save never counts);
multi-node needs a shared filesystem. A checkpoint belongs to one run (`run_id`, kept across resumes): a resume never
mixes its checkpoints with another run's."""

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
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, set_seed
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from training.batchnorm import average_running_statistics
from training.errors import ArgumentError, ResumeError
from training.optim import optimizer_for
from training.parts import CheckpointFiles, CheckpointLoad, ModelRunner, parts
from training.strategy_adapters import (TensorState, bare_model, base_optimizer, held_pieces, load_optimizer_states,
                                        model_tensors, own_class_while_saving, set_full_state, whole_shape)

TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"  # every other file of the checkpoint and its size in bytes
PLAIN_MODEL = "model.json"  # in final/: how to rebuild a plain nn.Module (its class and constructor arguments)
MODEL_STATE = "model_state"  # rank<N>.safetensors: each rank's pieces of every tensor's fp32 value and optimizer state
DEEPSPEED_DIR = "pytorch_model"  # what accelerate's save_state wrote for a DeepSpeed engine (before model_state/)
STEP_DIR = re.compile(r"^step_(\d+)$")

logger = get_logger(__name__)


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
    optim: str = ""  # the --optim whose state it holds ("": not recorded, before 2026-11-28)
    run_id: str = ""  # the run it belongs to, made at a fresh start and kept by every resume


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
    if resume == "latest":
        if found := latest_checkpoint(output_dir):  # (refused where checkpoints of several runs make it ambiguous)
            require_complete_checkpoint(found)
    elif resume:
        try:
            require_complete_checkpoint(Path(resume))
        except FileNotFoundError as error:
            raise ArgumentError(str(error)) from None
        others = [p for p in complete_checkpoints(output_dir) if p.resolve() != Path(resume).resolve()]
        if foreign := [p.name for p in others if run_of(p) != run_of(Path(resume))]:
            raise ArgumentError(f"{output_dir} holds checkpoints of another run ({', '.join(foreign[:3])}), which "
                                "rotation and 'latest' would take for this run's; resume into another --output_dir, or "
                                "move them elsewhere first")
        if newer := [p.name for p in others if step_of(p) > step_of(Path(resume))]:
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
        found = latest_checkpoint(output_dir)
        choice = [str(found) if found else None]
        if accelerator is not None:
            broadcast_object_list(choice)
        return require_complete_checkpoint(Path(choice[0])) if choice[0] else None
    return require_complete_checkpoint(Path(resume_from_checkpoint))


def latest_checkpoint(output_dir: str) -> Path | None:
    """The newest complete checkpoint of `output_dir`, refused where they belong to more than one run."""
    found = complete_checkpoints(output_dir)
    if len(runs := {run_of(path) for path in found}) > 1:
        raise ResumeError(f"{checkpoints_root(output_dir)} holds checkpoints of {len(runs)} runs, so 'latest' could "
                          "continue the wrong one; name the checkpoint with --resume_from_checkpoint, or move the "
                          "other run's elsewhere")
    return found[-1] if found else None


def recorded(checkpoint: Path) -> dict:
    """What a complete checkpoint's trainer_state.json says (nothing where it cannot be read: a resume says why)."""
    try:
        return json.loads((checkpoint / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return {}


def step_of(checkpoint: Path) -> int:
    return recorded(checkpoint).get("completed_steps", 0)


def run_of(checkpoint: Path) -> str:
    """The run a checkpoint belongs to ("" for checkpoints before 2026-11-28)."""
    return recorded(checkpoint).get("run_id", "")


def require_complete_checkpoint(path: Path) -> Path:
    """`path`, once it holds a complete checkpoint whose files are all there at the size they were saved."""
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path} (missing {TRAINER_STATE}); check --resume_from_checkpoint")
    if not (path / MANIFEST).is_file():  # (checkpoints before 2026-11-28 have none)
        return path
    try:
        sizes = json.loads((path / MANIFEST).read_text())
    except ValueError:
        raise ResumeError(f"{path / MANIFEST} is damaged; resume an earlier checkpoint") from None
    for name, size in sizes.items():
        file = path / name
        found = file.stat().st_size if file.is_file() else None
        if found != size:
            what = "is missing" if found is None else f"is damaged ({found:,} bytes, saved as {size:,})"
            raise ResumeError(f"{file} {what}; resume an earlier checkpoint (--resume_from_checkpoint <its path>)")
    return path


def write_manifest(checkpoint: Path) -> None:
    sizes = {str(file.relative_to(checkpoint)): file.stat().st_size for file in sorted(checkpoint.rglob("*"))
             if file.is_file() and file.name not in (MANIFEST, TRAINER_STATE)}
    (checkpoint / MANIFEST).write_text(json.dumps(sizes, indent=1))


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
    if isinstance(model, ModelRunner):  # a part's model that saves itself (pipeline stages)
        model.save(staging)
    else:
        save_model_state(accelerator, model, optimizer, staging / MODEL_STATE)
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


WHOLE = "whole"  # the offset of optimizer state kept as the optimizer holds it (`held_pieces`' offset None)


def save_model_state(accelerator: Accelerator, model: torch.nn.Module, optimizer, directory: Path) -> None:
    """Every rank writes the pieces it holds of every tensor and its optimizer state (`held_pieces`: no gathering, so
    as fast as the strategies' own saves) to one file, with the tensors' whole shapes; state that is a number (a step
    count) goes into the file's metadata, as JSON keeps it."""
    directory.mkdir(parents=True, exist_ok=True)
    base, rank, pieces, numbers, shapes = base_optimizer(optimizer), accelerator.process_index, {}, {}, {}
    for name, tensor in model_tensors(bare_model(accelerator, model)).items():
        shapes[name] = whole_shape(tensor)
        for key, (start, piece) in held_pieces(tensor, base, rank).items():
            if torch.is_tensor(piece):
                pieces[f"{name}|{key}|{WHOLE if start is None else start}"] = piece
            else:
                numbers[f"{name}|{key}"] = piece
    save_file(pieces, directory / f"rank{rank}.safetensors",
              metadata={"shapes": json.dumps(shapes), "numbers": json.dumps(numbers)})


class ModelState:
    """A checkpoint's `save_model_state` files, one per rank that saved it, read lazily: one whole tensor (and its
    optimizer state) assembled at a time."""

    def __init__(self, checkpoint: Path, files: contextlib.ExitStack) -> None:
        self.directory, self.shapes, self.pieces, self.numbers = checkpoint / MODEL_STATE, {}, {}, {}
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
            for key in handle.keys():
                name, kind, start = key.rsplit("|", 2)
                self.pieces.setdefault(name, {}).setdefault(kind, []).append((start, path, handle, key))

    def whole(self, name: str) -> TensorState:
        """`name`'s fp32 value and optimizer state, each assembled whole from the ranks' pieces."""
        state = TensorState(value=None, other=dict(self.numbers.get(name, {})))
        for kind, pieces in self.pieces.get(name, {}).items():
            if pieces[0][0] == WHOLE or kind == "step":  # the same on every rank that wrote it
                kept = self._read(*pieces[0][1:])  # (before 2026-11-28 a step count was a piece of one value)
                state.other[kind] = kept if pieces[0][0] == WHOLE else kept[0]
                continue
            flat, covered = torch.empty(math.prod(self.shapes[name])), 0
            for start, *where in pieces:
                piece = self._read(*where)
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
    def _read(path: Path, handle, key: str) -> torch.Tensor:
        try:
            return handle.get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise ResumeError(f"{path} is damaged ({str(error).splitlines()[0]}); resume an earlier checkpoint") from None


def load_model_state(accelerator: Accelerator, model: torch.nn.Module, base: torch.optim.Optimizer,
                     checkpoint: Path) -> None:
    """The checkpoint's `save_model_state` tensors into this run's model and optimizer (`base`: the one inside the
    wrappers, `base_optimizer`), however they are laid out."""
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
    """Keep `newest` (even below higher steps left by a resumed run) and the `limit - 1` highest others of its run."""
    others = [path for path in complete_checkpoints(output_dir) if path != newest and run_of(path) == run_of(newest)]
    for old in others[: max(len(others) - (limit - 1), 0)]:
        shutil.rmtree(old)


def load_checkpoint(accelerator: Accelerator, path: Path, global_batch: int, max_steps: int,
                    layout: dict[str, int] | None = None, model=None, optimizer=None, scheduler=None,
                    optim: str | None = None) -> TrainerState:
    """Check on every rank that `path` continues this run exactly (`optim`: this run's --optim), then restore it."""
    try:
        saved = json.loads((path / TRAINER_STATE).read_text())
        if (stages := saved.pop("pipeline_stages", 1)) > 1:  # how checkpoints before 2026-11-27 recorded a pipeline
            saved["layout"] = {"pipeline_stages": stages}
        state = TrainerState(**saved)
    except json.JSONDecodeError:
        raise ResumeError(f"{path / TRAINER_STATE} is damaged; resume an earlier checkpoint") from None
    except (TypeError, ValueError):
        raise ResumeError(f"{path / TRAINER_STATE} was not written by this version of train.py; cannot resume it")
    if optim and state.optim and optimizer_for(state.optim).class_path != optimizer_for(optim).class_path:
        raise ResumeError(f"{path} holds the state of --optim {state.optim}, and this run's is --optim {optim}; resume "
                          f"with --optim {state.optim}, or start a new run from that run's final/ with "
                          "--model_name_or_path (the optimizer state is not carried over)")
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
            # the parts' (parts/safe_loading: unpickling on an allow-list)
            for context in parts().loading_checkpoint(CheckpointLoad(path, (path / DEEPSPEED_DIR).is_dir())):
                loading.enter_context(context)
            with without_model_and_optimizer(accelerator, model if (path / MODEL_STATE).is_dir() else None):
                accelerator.load_state(str(path))
            if isinstance(model, ModelRunner):  # a part's model that loads itself (pipeline stages)
                model.load(path)
            parts().load_state(CheckpointFiles(accelerator, path))  # the parts' own
    except pickle.UnpicklingError:
        raise ResumeError(f"{path} holds pickled objects that are not plain tensors or data; refused to load them, "
                          "as unpickling can run code. Resume only checkpoints this template wrote") from None
    if (path / MODEL_STATE).is_dir():
        base = base_optimizer(optimizer)  # (made and linked once: ZeRO's state, training/strategy_adapters.py)
        load_model_state(accelerator, model, base, path)
        set_next_rate(base, getattr(scheduler, "scheduler", scheduler))
    # Resumes start at an optimizer-step boundary: the restored micro-step counter (when gradients sync) is stale if
    # accumulation or process count changed, or 0 on some ranks only (a missing rank file); mismatched syncs hang.
    accelerator.step = 0
    return state


def resume(accelerator: Accelerator, path: Path, this_run: TrainerState, max_steps: int, seed: int, model, optimizer,
           scheduler) -> TrainerState:
    """Restore `path` into this run (`this_run`: its fresh state), on every rank; the state to continue from."""
    state = load_checkpoint(accelerator, path, this_run.global_batch, max_steps, this_run.layout, model, optimizer,
                            scheduler, this_run.optim)
    reseeded = ""
    if state.num_processes != this_run.num_processes:  # a rank's saved generators have no counterpart now
        set_seed(seed + state.completed_steps)  # alike on every rank, as a fresh start seeds them
        reseeded = f"; random generators reseeded from --seed + step {state.completed_steps}"
    if (state.strategy, state.num_processes) != (this_run.strategy, this_run.num_processes):
        saved_on = f"{state.num_processes} process{'es' if state.num_processes > 1 else ''}"
        logger.info(f"resuming a {state.strategy or 'older'} checkpoint of {saved_on} under {this_run.strategy} with "
                    f"{this_run.num_processes}{reseeded}", main_process_only=True)
    state.num_processes, state.strategy, state.optim = this_run.num_processes, this_run.strategy, this_run.optim
    logger.info(f"resumed from {path} at step {state.completed_steps}", main_process_only=True)
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
