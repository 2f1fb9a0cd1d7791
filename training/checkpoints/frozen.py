"""What a checkpoint records of a model the run reads and never trains (DPO's reference, a distillation teacher):
where it came from, its configuration and a checksum of its weights. A resume that reads another one is refused in
one line, unless named on purpose (`--allow_config_changes reference_model`): the loss would silently change
otherwise. The part that loads the model saves and checks its record (`<role>.json` in the checkpoint)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from accelerate.logging import get_logger

from training.checkpoints.files import file_sha256
from training.errors import ResumeError

logger = get_logger(__name__)

WEIGHT_FILES = ("model*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "*.bin.index.json")


def frozen_identity(source: str, model=None, accelerator=None) -> dict[str, Any]:
    """`model`'s record, loaded from `source` (a directory: the SHA-256 of the weight files from_pretrained reads; a
    Hub id: its commit), hashed by the main process alone where `accelerator` runs several. Without the model (not
    loaded: its scores were saved), its configuration is not compared, nor a Hub model's weights."""
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([frozen_identity(source, model) if accelerator.is_main_process else None])[0]
    from training.checkpoints.resume import as_recorded  # (resume.py imports the parts' hooks)

    config = getattr(model, "config", None)
    return {"source": source, "config": None if model is None else as_recorded(config.to_dict() if config else {}),
            "weights": weights_checksum(Path(source)) if Path(source).is_dir()
            else None if model is None else f"revision {getattr(config, '_commit_hash', None)}"}


def weights_checksum(directory: Path) -> str:
    """One SHA-256 of a model directory's weight files, by name and content."""
    digest = hashlib.sha256()
    for file in sorted({path for pattern in WEIGHT_FILES for path in directory.glob(pattern) if path.is_file()}):
        digest.update(f"{file.relative_to(directory)}:{file_sha256(file)}\n".encode())
    return digest.hexdigest()


def save_frozen_identity(directory: Path, role: str, identity: dict[str, Any]) -> None:
    """Main process: the record into the checkpoint being written (the manifest lists and hashes it)."""
    (directory / f"{role}.json").write_text(json.dumps(identity, indent=1))


def check_frozen_identity(directory: Path, role: str, identity: dict[str, Any], flag: str,
                          allowed: str | None) -> dict[str, Any]:
    """Every rank: refuse a resume that reads another `role` model than the checkpoint's run read (its weights or
    configuration differ; where neither can be compared, its source), unless `allowed` (--allow_config_changes) names
    the role; a model moved elsewhere, the same, is logged. A checkpoint that records none (saved before 2026-12-07)
    is taken as it is. Returns the record this run keeps: the checkpoint's, where this run's could not say all."""
    try:
        saved = json.loads((directory / f"{role}.json").read_text())
    except FileNotFoundError:
        return identity
    except ValueError:
        raise ResumeError(f"{directory / f'{role}.json'} is damaged; resume an earlier checkpoint") from None
    comparable = [key for key in ("weights", "config") if identity[key] is not None and saved.get(key) is not None]
    differ = [key for key in comparable if saved[key] != identity[key]] or (
        ["source"] if not comparable and saved.get("source") != identity["source"] else [])
    kept = identity if all(identity[key] is not None for key in ("weights", "config")) else saved | {
        "source": identity["source"]}
    if not differ:
        if saved.get("source") != identity["source"]:
            logger.warning(f"{role.replace('_', ' ')}: {saved.get('source')} -> {identity['source']}, the same weights "
                           "and configuration", main_process_only=True)
        return kept
    named = " and ".join({"weights": "weights", "config": "configuration", "source": "source"}[key] for key in differ)
    what = (f"{role.replace('_', ' ')} {saved.get('source')} -> {identity['source']} (its {named} "
            f"{'differ' if 'weights' in differ else 'differs'})")
    if role in {name.strip() for name in (allowed or "").split(",")}:
        logger.warning(f"resuming with another {what} (--allow_config_changes {role})", main_process_only=True)
        return identity
    raise ResumeError(f"{directory} was trained against another {what}; resume with --{flag} {saved.get('source')}, "
                      f"or name the change on purpose: --allow_config_changes {role}")
