"""One resume, in the order it runs: which checkpoint (`resolve_resume_path`), checked against this run and loaded
(`load_checkpoint`), then `resume`: the state to continue from, the generators reseeded where the process count
changed, metrics.jsonl cut back to the checkpoint's step, and the data position to skip to (`epoch_batches`)."""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from torch.utils.data import DataLoader

from training.checkpoints.changes import check_changes, log_changes, restore_rates, this_runs_rates
from training.checkpoints.files import (
    DEEPSPEED_DIR,
    MANIFEST,
    TRAINER_STATE,
    TrainerState,
    file_problem,
    identity_problem,
    latest_checkpoint,
    manifest_files,
    checkpoint_files,
    recorded_identity,
    require_complete_checkpoint,
    stamp_problem,
    unlisted_files,
)
from training.checkpoints.save import without_model_and_optimizer
from training.checkpoints.tensors import MODEL_STATE
from training.errors import ResumeError
from training.metrics import keep_metrics_until
from training.optim import optimizer_for
from training.parts import CheckpointFiles, CheckpointLoad, parts

if TYPE_CHECKING:
    from training.runner import ModelRunner

logger = get_logger(__name__)


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


# a transformers config's fields (at any depth) that say how a run uses the model, not what the model is; and a peft
# adapter's that name where its base came from
RUNTIME_CONFIG_FIELDS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
                         "output_attentions", "output_hidden_states", "return_dict", "torchscript", "_attn_implementation",
                         "attn_implementation", "_attn_implementation_autoset", "_commit_hash", "base_model_name_or_path",
                         "revision", "inference_mode", "architectures"}  # (how a model was named, not what it computes)


def model_description(task, model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint records of the model it holds, as JSON keeps it: a transformers config's fields (less how a
    run uses it: `RUNTIME_CONFIG_FIELDS`), a peft adapter's settings (its rank, alpha, dropout, targets), a plain
    module's constructor arguments. Not the task's data settings (a block size): a flag, `check_changes` logs it."""
    config = getattr(model, "config", None)
    adapters = getattr(model, "peft_config", {})
    return as_recorded({"config": config.to_dict() if hasattr(config, "to_dict") else {},
                   "adapter": {key if name == "default" else f"{name}.{key}": value
                               for name, adapter in adapters.items() for key, value in adapter.to_dict().items()},
                   "model_kwargs": task.model_kwargs or {}})


def as_recorded(value: Any) -> Any:
    """`value` as JSON holds it, the same in every process: runtime fields dropped, sets sorted, anything else not
    JSON as its text."""
    if isinstance(value, dict):
        return {str(key): as_recorded(item) for key, item in value.items() if key not in RUNTIME_CONFIG_FIELDS}
    if isinstance(value, set | frozenset):
        return sorted(as_recorded(item) for item in value)
    if isinstance(value, list | tuple):
        return [as_recorded(item) for item in value]
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)


class Absent:
    """The value of a field one side of `config_differences` lacks."""

    def __repr__(self) -> str:
        return "none"


ABSENT = Absent()


def config_differences(saved: dict[str, Any], this_run: dict[str, Any]) -> dict[tuple[str, str], tuple[Any, Any]]:
    """The fields whose values differ, by (section, field): (the checkpoint's, this run's; `ABSENT` where one lacks
    it)."""
    def flat(described: dict[str, Any]) -> dict[tuple[str, str], Any]:
        return {(section, key): value for section, values in described.items() for key, value in values.items()}

    before, after = flat(saved), flat(this_run)
    return {key: (before.get(key, ABSENT), after.get(key, ABSENT)) for key in sorted(before.keys() | after.keys())
            if before.get(key, ABSENT) != after.get(key, ABSENT)}


def check_same_model(path: Path, saved: dict[str, Any], this_run: dict[str, Any], allowed: str | None,
                     other_shapes: str | None = None, trained_with: str = "") -> None:
    """Refuse a checkpoint of another model (`model_description`s: another activation, norm epsilon, RoPE theta... load
    and train silently otherwise), unless `allowed` (--allow_config_changes) names each differing field; where the
    tensors' shapes differ too (`other_shapes`: the first, `shapes_differ`), no field may change (`trained_with`: the
    model flags the checkpoint's run gave, named in the line)."""
    saved, this_run = ({section: values for section, values in described.items() if section != "settings"}
                       for described in (saved, this_run))  # (the task's settings: recorded until 2026-12-07)
    if other_shapes:
        differing = ", ".join(f"{field} ({old!r} -> {new!r})" for (_, field), (old, new) in
                              list(config_differences(saved, this_run).items())[:4])
        raise ResumeError(f"{path} holds another model ({other_shapes}{'; ' + differing if differing else ''}); use "
                          f"the --model_config, --config_overrides or --model_name_or_path it was trained with"
                          f"{f' ({trained_with})' if trained_with else ''}")
    if not saved:  # (checkpoints before 2026-12-04 record none)
        return
    allowed_fields = {field.strip() for field in (allowed or "").split(",") if field.strip()}
    differences = config_differences(saved, this_run)
    named = {key: values for key, values in differences.items() if key[1] in allowed_fields}

    def shown(values: dict[tuple[str, str], tuple[Any, Any]]) -> str:
        return ", ".join(f"{field} ({old!r} -> {new!r})" for (_, field), (old, new) in values.items())

    if refused := {key: values for key, values in differences.items() if key not in named}:
        raise ResumeError(f"{path} holds a model configured otherwise: {shown(refused)}; resume with the flags it was "
                          f"trained with, or name the fields you change on purpose (shapes must still match): "
                          f"--allow_config_changes {','.join(field for _, field in refused)}")
    if named:
        logger.warning(f"resuming {path} with changed {shown(named)} (--allow_config_changes)", main_process_only=True)


def layout_differences(saved: dict[str, dict], this_run: dict[str, dict], flags: dict[str, Any]) -> list[str]:
    """Each setting of a part's `checkpoint_layout` the checkpoint recorded otherwise (by part: `config_differences`'
    sections), as `parts/pipeline: --pipeline_stages was 4, is 2` (a setting a flag sets, named as the flag)."""
    return [f"parts/{part}: {'--' * (key in flags)}{key} was {before!r}, is {after!r}"
            for (part, key), (before, after) in config_differences(saved, this_run).items()]


def shapes_differ(path: Path, accelerator: Accelerator | None, model: torch.nn.Module | None) -> str | None:
    """The first tensor whose shape the checkpoint's manifest records otherwise than `model` holds it (None: the same
    tensors, or nothing recorded)."""
    from training.strategy import bare_model
    from training.strategy.shares import model_tensors, whole_shape

    try:
        recorded = json.loads((path / MANIFEST).read_text()).get("tensors", {})
    except (OSError, ValueError, AttributeError):
        return None  # (a missing or damaged manifest is named by `verify_checkpoint`)
    if model is None or not recorded:
        return None
    held = {name: list(whole_shape(tensor)) for name, tensor in
            model_tensors(bare_model(accelerator, model) if accelerator else model).items()}
    for name in sorted(recorded.keys() | held.keys()):
        saved, here = recorded.get(name, {}).get("shape"), held.get(name)
        if saved != here:
            return f"{name}: {saved if saved is not None else 'absent'} there, {here if here is not None else 'absent'} here"
    return None


def verify_checkpoint(accelerator: Accelerator | None, path: Path, unchecked: bool = False) -> list[str]:
    """Every file of `path` against its manifest (size, SHA-256, and the run and step each file says it is of) before
    anything is loaded: each rank checks its share of the files, in parallel, and every rank stops on the first
    problem any rank found. A checkpoint without a manifest, or a file listed without a SHA-256, is refused unless
    `unchecked` (--resume_unchecked, logged). Returns the files the manifest does not list (`listed_only` hides them)."""
    if problem := identity_problem(path):
        raise ResumeError(f"{problem}; resume an earlier checkpoint")
    listed = manifest_files(path)
    if listed is None and not unchecked:
        raise ResumeError(f"{path} has no {MANIFEST}, so nothing proves its files whole and of one run; resume a "
                          "checkpoint saved with its manifest, or this one unchecked on purpose with --resume_unchecked")
    if listed is not None and TRAINER_STATE not in listed:  # (every save lists it: emptied, edited)
        if not unchecked:
            raise ResumeError(f"{path / MANIFEST} does not list {TRAINER_STATE}, which every save lists: it is damaged "
                              "or edited; resume an earlier checkpoint, or this one unchecked on purpose with "
                              "--resume_unchecked")
        listed = None  # (unchecked: as a checkpoint without one)
    if unchecked and (listed is None or any("sha256" not in entry for entry in listed.values())):
        logger.warning(f"resuming {path} unchecked (--resume_unchecked): its files are not proven whole nor of one "
                       "run", main_process_only=True)
    rank, processes = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    if listed is None:  # (unchecked: what each file says of itself is still compared)
        expected = recorded_identity(path)
        problems = [problem for name in checkpoint_files(path)[rank::processes]
                    if (problem := stamp_problem(path / name, expected))]
    else:
        problems = [problem for name, entry in sorted(listed.items())[rank::processes]
                    if (problem := file_problem(path, name, entry, unchecked=unchecked))]
    if processes > 1:
        problems = gather_object(problems)
    if problems:
        raise ResumeError(f"{problems[0]}; resume an earlier checkpoint (--resume_from_checkpoint <its path>)")
    return [] if listed is None else unlisted_files(path, listed)


@contextlib.contextmanager
def listed_only(path: Path, unlisted: list[str]) -> Iterator[Path]:
    """`path`, or where files the manifest does not list lie in it (copied in after the save), a view of it that
    holds the listed files alone (links in a directory of this process's own): no reader sees the others."""
    if not unlisted:
        yield path
        return
    logger.warning(f"{path} holds files its {MANIFEST} does not list, which are not read: {', '.join(unlisted[:5])}"
                   f"{'...' if len(unlisted) > 5 else ''}", main_process_only=True)
    scratch = Path(tempfile.mkdtemp(prefix="listed-files-"))
    view = scratch / path.name  # (named as the checkpoint: messages name its step)
    try:
        for name in [*manifest_files(path), MANIFEST]:
            (view / name).parent.mkdir(parents=True, exist_ok=True)
            (view / name).symlink_to((path / name).resolve())
        try:
            yield view
        except ResumeError as error:  # (named as the user knows it)
            raise ResumeError(str(error).replace(str(view), str(path))) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_checkpoint(accelerator: Accelerator | None, path: Path, this_run: TrainerState, max_steps: float,
                    runner: ModelRunner | None = None, model=None, optimizer=None, scheduler=None,
                    allowed_changes: str | None = None, unchecked: bool = False,
                    evaluating: bool = False) -> TrainerState:
    """Check on every rank that `path` continues this run (`this_run`: its fresh state: its global batch, layout,
    --optim, optimizer groups, model (`model_description`) and flags, each changed one honoured or refused by
    `check_changes`), that its files are whole and its own (`verify_checkpoint`), then restore what its manifest
    lists: accelerate's `load_state` of the schedule (at this run's learning rates), generators and data position, the
    runner's model and optimizer state, the parts' own files. `evaluating` (--do_train false): the model and its
    layout alone must match."""
    try:
        saved = json.loads((path / TRAINER_STATE).read_text())
        layout = saved.get("layout", {})  # a pipeline as recorded before 2026-11-27 (beside the steps), 2026-12-08 (flat)
        if (stages := saved.pop("pipeline_stages", 1)) > 1 or any(type(cut) is not dict for cut in layout.values()):
            saved["layout"] = {"pipeline": layout or {"pipeline_stages": stages}}
        state = TrainerState(**saved)
    except json.JSONDecodeError:
        raise ResumeError(f"{path / TRAINER_STATE} is damaged; resume an earlier checkpoint") from None
    except (TypeError, ValueError):
        raise ResumeError(f"{path / TRAINER_STATE} was not written by this version of train.py; cannot resume it")
    if not evaluating and this_run.optim and state.optim and \
            optimizer_for(state.optim).class_path != optimizer_for(this_run.optim).class_path:
        raise ResumeError(f"{path} holds the state of --optim {state.optim}, and this run's is --optim {this_run.optim}; "
                          f"resume with --optim {state.optim}, or start a new run from that run's final/ with "
                          "--model_name_or_path (the optimizer state is not carried over)")
    if state.completed_steps >= max_steps:
        raise ResumeError(f"{path} is at step {state.completed_steps} and --max_steps is {max_steps}: nothing left "
                          "to train; raise --max_steps (the learning-rate schedule then stretches to the new length)")
    if not evaluating and state.global_batch != this_run.global_batch:
        raise ResumeError(
            f"{path} was trained with a global batch of {state.global_batch}, this run has {this_run.global_batch}; "
            "keep per_device_train_batch_size x processes x gradient_accumulation_steps the same to resume")
    if differences := layout_differences(state.layout, this_run.layout, this_run.flags):
        raise ResumeError(f"{path} holds a model laid out otherwise: {'; '.join(differences)}; resume with the flags "
                          "that laid it out so, or start a new run from that run's final/ with --model_name_or_path "
                          "(the optimizer state is not carried over)")
    trained_with = " ".join(f"--{flag} {state.flags[flag]}" for flag in ("model_name_or_path", "model_config",
                                                                          "config_overrides") if state.flags.get(flag))
    check_same_model(path, state.model, this_run.model, allowed_changes,  # (a pipeline's stages hold some tensors)
                     None if this_run.layout else shapes_differ(path, accelerator, model), trained_with)
    changes = [] if evaluating else check_changes(path, state, this_run)
    if (path / DEEPSPEED_DIR).is_dir() and state.num_processes != accelerator.num_processes:
        raise ResumeError(
            f"{path} is a DeepSpeed checkpoint of {state.num_processes} processes; DeepSpeed cannot resume it on "
            f"{accelerator.num_processes}. Resume on {state.num_processes} processes, or convert it to full weights with "
            f"`python {path}/zero_to_fp32.py {path} <out_dir> --safe_serialization`, copy config.json and the "
            "tokenizer files from final/ into <out_dir>, and start a new run from --model_name_or_path <out_dir> "
            "(the optimizer state is not carried over)")
    unlisted = verify_checkpoint(accelerator, path, unchecked)
    rates = this_runs_rates(scheduler)  # accelerate's load_state restores the checkpoint's: this run's are honoured
    try:
        with contextlib.ExitStack() as loading:
            readable = loading.enter_context(listed_only(path, unlisted))
            # the parts' (parts/safe_loading: unpickling on an allow-list)
            for context in parts().loading_checkpoint(CheckpointLoad(readable, (path / DEEPSPEED_DIR).is_dir())):
                loading.enter_context(context)
            with without_model_and_optimizer(accelerator, emptied=(path / MODEL_STATE).is_dir()):
                accelerator.load_state(str(readable))
            restore_rates(scheduler, rates)
            if runner is not None:
                runner.load(model, None if evaluating else optimizer, scheduler, readable)
            parts().load_state(CheckpointFiles(accelerator, readable))  # the parts' own
    except pickle.UnpicklingError:
        raise ResumeError(f"{path} holds pickled objects that are not plain tensors or data; refused to load them, "
                          "as unpickling can run code. Resume only checkpoints this template wrote") from None
    log_changes(changes)
    # Resumes start at an optimizer-step boundary: the restored micro-step counter (when gradients sync) is stale if
    # accumulation or process count changed, or 0 on some ranks only (a missing rank file); mismatched syncs hang.
    accelerator.step = 0
    return state


def resume(accelerator: Accelerator, path: Path, this_run: TrainerState, max_steps: int, seed: int,
           runner: ModelRunner, model, optimizer, scheduler, output_dir: str,
           allowed_changes: str | None = None, unchecked: bool = False, evaluating: bool = False) -> TrainerState:
    """Restore `path` into this run (`this_run`: its fresh state), on every rank; the state to continue from. The
    generators are reseeded where the process count changed, and metrics.jsonl keeps only what was logged up to the
    checkpoint's step (the trackers' own purge: `tracker_purge_step`). `unchecked`: --resume_unchecked; `evaluating`:
    --do_train false (`load_checkpoint`)."""
    state = load_checkpoint(accelerator, path, this_run, math.inf if evaluating else max_steps, runner, model,
                            optimizer, scheduler, allowed_changes, unchecked, evaluating)
    reseeded = ""
    if state.num_processes != this_run.num_processes:  # a rank's saved generators have no counterpart now
        set_seed(seed + state.completed_steps)  # alike on every rank, as a fresh start seeds them
        reseeded = f"; random generators reseeded from --seed + step {state.completed_steps}"
    if (state.strategy, state.num_processes) != (this_run.strategy, this_run.num_processes):
        saved_on = f"{state.num_processes} process{'es' if state.num_processes > 1 else ''}"
        logger.info(f"resuming a {state.strategy or 'older'} checkpoint of {saved_on} under {this_run.strategy} with "
                    f"{this_run.num_processes}{reseeded}", main_process_only=True)
    state.num_processes, state.strategy, state.optim, state.model, state.flags, state.optimizer_groups = (
        this_run.num_processes, this_run.strategy, this_run.optim, this_run.model, this_run.flags,
        this_run.optimizer_groups)
    if accelerator.is_main_process:
        keep_metrics_until(output_dir, state.completed_steps)
    logger.info(f"resumed from {path} at step {state.completed_steps}", main_process_only=True)
    return state


def tracker_purge_step(state: TrainerState, resumed: bool) -> int:
    """Where TensorBoard drops what the run this one continues logged after its checkpoint (0: nothing to drop)."""
    return state.completed_steps + 1 if resumed else 0


def epoch_batches(accelerator: Accelerator, loader: DataLoader | Iterable[dict], state: TrainerState,
                  accumulation: int) -> Iterator[dict]:
    """The micro-batches from where the run stands: a map-style loader is reshuffled for the epoch and skips what
    the epoch already trained on; a part's loader keeps its own position (a stream's: endless, epoch after epoch).
    Skipping by optimizer steps, not by this process's batches, keeps the position right when a checkpoint resumes
    on a different number of processes."""
    if not isinstance(loader, DataLoader):
        return iter(loader)
    loader.set_epoch(state.epoch)
    return accelerator.skip_first_batches(loader, state.steps_in_epoch * accumulation)
