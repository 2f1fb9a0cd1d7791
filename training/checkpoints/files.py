"""A checkpoint's files on disk: `trainer_state.json` (`TrainerState`), `manifest.json` (every file's size and
SHA-256 and the run and step it belongs to, every tensor's shape and dtype: checked before a resume), where
checkpoints live, which is the latest, rotation, and the output directory's checks."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

from training.errors import ArgumentError, ResumeError

TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"  # the run and step; every other file's size and SHA-256; every tensor's shape and dtype
PLAIN_MODEL = "model.json"  # in final/: how to rebuild a plain nn.Module (its class and constructor arguments)
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
    layout: dict[str, dict[str, Any]] = field(default_factory=dict)  # by part: how it cuts the model (`checkpoint_layout`)
    per_device_train_batch_size: int = 0  # the micro-batch that ran (0: not recorded, before --auto_find_batch_size)
    gradient_accumulation_steps: int = 0
    optim: str = ""  # the --optim whose state it holds ("": not recorded, before 2026-11-28)
    run_id: str = ""  # the run it belongs to, made at a fresh start and kept by every resume
    model: dict[str, Any] = field(default_factory=dict)  # the model's configuration (`model_description`)
    flags: dict[str, Any] = field(default_factory=dict)  # every flag's value (a resume honours or refuses changes)
    optimizer_groups: int = 0  # the optimizer's parameter groups (0: not recorded, before 2026-12-07)


def checkpoints_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = [(int(m.group(1)), p) for p in checkpoints_root(output_dir).glob("step_*")
             if (m := STEP_DIR.match(p.name)) and (p / TRAINER_STATE).is_file()]
    return [path for _, path in sorted(found)]


RUN_OUTPUTS = ("checkpoints", "final", "runs", "metrics.jsonl", "summary.json", "report.png")


def check_output_dir(output_dir: str, resume: str | None, overwrite: bool, inputs: dict[str, str | None],
                     evaluating: bool = False) -> None:
    """Before any process group: resume/overwrite flags agree, overwriting deletes no input (flag -> path), writable;
    `evaluating` (--do_train false): a checkpoint named by its path, into an output_dir that holds no run."""
    if evaluating and resume == "latest":
        raise ArgumentError("--do_train false --resume_from_checkpoint latest: an evaluation writes into an --output_dir "
                            "of its own, where 'latest' finds nothing; give the checkpoint's path")
    held = [name for name in ("checkpoints", "final", "metrics.jsonl", "summary.json") if (Path(output_dir) / name).exists()]
    if evaluating and held:
        raise ArgumentError(f"--do_train false writes its evaluation to {output_dir}'s metrics.jsonl and summary.json, "
                            f"and {output_dir} holds a run's ({', '.join(held)}); give the evaluation another --output_dir")
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


def latest_checkpoint(output_dir: str) -> Path | None:
    """The newest complete checkpoint of `output_dir`, refused where they belong to more than one run, or where one's
    trainer_state.json cannot be read (it cannot say which run it is of)."""
    found = complete_checkpoints(output_dir)
    for checkpoint in found:
        if problem := state_problem(checkpoint):
            raise ResumeError(f"{problem}, so 'latest' cannot tell which run it belongs to; move {checkpoint} "
                              "elsewhere, or name the checkpoint to resume with --resume_from_checkpoint")
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


def state_problem(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint's trainer_state.json (None: it reads as a mapping)."""
    try:
        state = json.loads((checkpoint / TRAINER_STATE).read_text())
    except OSError as error:
        return f"{checkpoint / TRAINER_STATE} cannot be read ({error.strerror})"
    except ValueError as error:
        return f"{checkpoint / TRAINER_STATE} is damaged ({error})"
    return None if isinstance(state, dict) else f"{checkpoint / TRAINER_STATE} is damaged (not a JSON object)"


def step_of(checkpoint: Path) -> int:
    return recorded(checkpoint).get("completed_steps", 0)


def run_of(checkpoint: Path) -> str:
    """The run a checkpoint belongs to ("" for checkpoints before 2026-11-28)."""
    return recorded(checkpoint).get("run_id", "")


def require_complete_checkpoint(path: Path) -> Path:
    """`path`, once it holds a complete checkpoint whose files are all there at the size they were saved (their
    bytes are checked by `verify_checkpoint`, with the process group)."""
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path} (missing {TRAINER_STATE}); check --resume_from_checkpoint")
    if path.is_symlink():  # a save at its step would replace the link, not a checkpoint of this run
        raise ResumeError(f"{path} is a symbolic link (to {path.resolve()}); resume the checkpoint by its own path, and "
                          "delete the link: a save at its step would have to replace it")
    if problem := state_problem(path):
        raise ResumeError(f"{problem}; resume an earlier checkpoint")
    if (named := STEP_DIR.match(path.name)) and int(named.group(1)) != step_of(path):
        raise ResumeError(f"{path} is named for step {named.group(1)} and holds step {step_of(path)} (renamed or copied "
                          f"by hand); rename it step_{step_of(path)}, or resume the checkpoint of step {named.group(1)}")
    for name, entry in (manifest_files(path) or {}).items():
        if problem := file_problem(path, name, entry, read_bytes=False, unchecked=True):  # (the checksums: later)
            raise ResumeError(f"{problem}; resume an earlier checkpoint (--resume_from_checkpoint <its path>)")
    return path


def manifest_files(path: Path) -> dict[str, dict[str, Any]] | None:
    """The checkpoint's files by relative path, each {"bytes", and since 2026-12-04 "sha256", "run_id", "step"}; None
    where there is no manifest (checkpoints before 2026-11-28, or one copied without it: `verify_checkpoint` refuses
    it unless --resume_unchecked). Before 2026-12-04 it held the sizes alone."""
    if not (path / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = ({name: {"bytes": int(size)} for name, size in manifest.items()} if "files" not in manifest
                 else {name: dict(entry) for name, entry in manifest["files"].items()})
    except (ValueError, TypeError, AttributeError):
        raise ResumeError(f"{path / MANIFEST} is damaged; resume an earlier checkpoint") from None
    if outside := [name for name in files if Path(name).is_absolute() or ".." in Path(name).parts]:
        raise ResumeError(f"{path / MANIFEST} lists {outside[0]}, outside the checkpoint: it is damaged or edited; "
                          "resume an earlier checkpoint")
    return files


def unlisted_files(path: Path, listed: dict[str, dict[str, Any]]) -> list[str]:
    """The files of a checkpoint its manifest does not list (copied in after the save): never read."""
    return [name for name in checkpoint_files(path) if name not in listed]


def file_sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def checkpoint_files(checkpoint: Path) -> list[str]:
    """Every file of a checkpoint the manifest lists: all but the manifest."""
    return [str(file.relative_to(checkpoint)) for file in sorted(checkpoint.rglob("*"))
            if file.is_file() and file.name != MANIFEST]


def write_manifest(checkpoint: Path, run_id: str, step: int, sha256: dict[str, str], tensors: dict[str, dict]) -> None:
    """Every file's size and SHA-256 (`sha256`: by relative path) and the run and step it belongs to, and every
    tensor's shape and dtype."""
    files = {name: {"bytes": (checkpoint / name).stat().st_size, "sha256": sha256[name], "run_id": run_id, "step": step}
             for name in checkpoint_files(checkpoint)}
    manifest = {"run_id": run_id, "step": step, "files": files, "tensors": tensors}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest, indent=1))


def file_problem(checkpoint: Path, name: str, entry: dict[str, Any], read_bytes: bool = True,
                 unchecked: bool = False) -> str | None:
    """What is wrong with one file of a checkpoint against its manifest entry (None: nothing): missing, another
    run's or another step's (as a model_state file says of itself, whatever the manifest says of it), damaged in
    place, or listed without a SHA-256 (`unchecked`: --resume_unchecked lets that pass). `read_bytes` False: its size
    and stamp only, before the process group; the SHA-256 needs the bytes. Never raises: every rank gets to say."""
    file = checkpoint / name
    try:
        if not file.is_file():
            return f"{file} is missing"
        if problem := stamp_problem(file, recorded_identity(checkpoint)):
            return problem
        size = file.stat().st_size
        if size != int(entry["bytes"]):
            return f"{file} is damaged ({size:,} bytes, saved as {int(entry['bytes']):,})"
        if "sha256" not in entry:
            return None if unchecked else (f"{checkpoint / MANIFEST} lists {name} without a SHA-256 (a checkpoint "
                                           "saved before 2026-12-04, or an edited manifest), so its bytes cannot be "
                                           "checked; resume it unchecked on purpose with --resume_unchecked")
        if read_bytes and file_sha256(file) != entry["sha256"]:
            return f"{file} is damaged (its bytes differ from the SHA-256 saved with it)"
        return None
    except (OSError, KeyError, TypeError, ValueError) as error:
        return f"{file} cannot be checked ({error}; the manifest entry {entry!r})"


def stamp_problem(file: Path, expected: dict[str, Any]) -> str | None:
    """A file that says of itself (its stamp: a safetensors file's metadata) that it is of another run or step."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, "pt") as handle:
            own = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError):
        return None
    if own.get("run_id", expected["run_id"]) != expected["run_id"]:
        return f"{file} belongs to run {own['run_id']}, this checkpoint to run {expected['run_id']}"
    if str(own.get("step", expected["step"])) != str(expected["step"]):
        return f"{file} was saved at step {own['step']}, this checkpoint at step {expected['step']}"
    return None


def recorded_identity(checkpoint: Path) -> dict[str, Any]:
    """The run and step a checkpoint belongs to, as its trainer_state.json records them."""
    state = recorded(checkpoint)
    return {"run_id": state.get("run_id", ""), "step": state.get("completed_steps", 0)}


def identity_problem(checkpoint: Path) -> str | None:
    """trainer_state.json and the manifest of one checkpoint name another run or step (None: they agree)."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, ValueError):
        return None  # (none before 2026-11-28; a damaged one is named by `manifest_files`)
    saved, expected = (manifest.get("run_id"), manifest.get("step")), recorded_identity(checkpoint)
    if "files" in manifest and saved != (expected["run_id"], expected["step"]):
        return (f"{checkpoint / TRAINER_STATE} belongs to run {expected['run_id']} at step {expected['step']}, its "
                f"{MANIFEST} to run {saved[0]} at step {saved[1]}: the checkpoint mixes two")
    return None


def rotate_checkpoints(output_dir: str, newest: Path, limit: int) -> None:
    """Keep `newest` (even below higher steps left by a resumed run) and the `limit - 1` highest others of its run."""
    others = [path for path in complete_checkpoints(output_dir) if path != newest and run_of(path) == run_of(newest)]
    for old in others[: max(len(others) - (limit - 1), 0)]:
        if old.is_symlink():  # a link put there by hand: what it points to is kept
            old.unlink()
        else:
            shutil.rmtree(old)
