"""Resumable checkpoints (`output_dir/checkpoints/step_N`) and the final export (`output_dir/final`).

A checkpoint is accelerate's `save_state` (model, optimizer, scheduler, RNG and sampler
state, in each strategy's native sharded format) plus `trainer_state.json`, written last
by the main process: a directory without it is incomplete and never resumed from.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

TRAINER_STATE = "trainer_state.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    """Where training stands; enough to continue exactly."""

    completed_steps: int = 0
    epoch: int = 0
    batches_seen_in_epoch: int = 0  # micro-batches per process consumed in `epoch`


def checkpoints_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / TRAINER_STATE).is_file()]
    return [path for _, path in sorted(found)]


def resolve_resume_path(resume_from_checkpoint: str | None, output_dir: str) -> Path | None:
    """`latest` means the newest complete checkpoint in output_dir (none yet: start fresh)."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint == "latest":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume_from_checkpoint)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path} (missing {TRAINER_STATE}); check --resume_from_checkpoint")
    return path


def save_checkpoint(accelerator: Accelerator, output_dir: str, state: TrainerState, save_total_limit: int | None) -> Path:
    """Save on every rank (sharded strategies need all of them), then mark complete and rotate."""
    path = checkpoints_root(output_dir) / f"step_{state.completed_steps}"
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (path / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=2))
        if save_total_limit:
            for old in complete_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator: Accelerator, path: Path) -> TrainerState:
    """Restore model, optimizer, scheduler and RNG state; return where training stood."""
    accelerator.load_state(str(path))
    return TrainerState(**json.loads((path / TRAINER_STATE).read_text()))


def export_final(accelerator: Accelerator, model, tokenizer: PreTrainedTokenizerBase, output_dir: str) -> Path:
    """Write full safetensors weights, config and tokenizer that `transformers` loads alone.

    `get_state_dict` gathers the shards (ZeRO-3, FSDP2) and must run on every rank.
    """
    final_dir = Path(output_dir) / "final"
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(
        final_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state_dict
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(final_dir)
    accelerator.wait_for_everyone()
    return final_dir
