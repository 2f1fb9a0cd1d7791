"""Which checkpoints count as complete: `latest` and rotation never see a half-written one."""

from __future__ import annotations

import json

import pytest

from training.arguments import ArgumentError, parse_args
from training.checkpoint import TRAINER_STATE, complete_checkpoints, resolve_resume_path


def make_checkpoint(root, name: str, complete: bool) -> None:
    directory = root / "checkpoints" / name
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"weights")
    if complete:
        (directory / TRAINER_STATE).write_text(json.dumps({"completed_steps": int(name.split("_")[1].split(".")[0])}))


def test_latest_is_the_newest_complete_checkpoint(tmp_path) -> None:
    make_checkpoint(tmp_path, "step_2", complete=True)
    make_checkpoint(tmp_path, "step_10", complete=True)  # newer than step_2 by number, not by name
    make_checkpoint(tmp_path, "step_12.tmp", complete=True)  # a save killed before its rename
    make_checkpoint(tmp_path, "step_14", complete=False)  # no trainer_state.json
    assert [p.name for p in complete_checkpoints(str(tmp_path))] == ["step_2", "step_10"]
    assert resolve_resume_path("latest", str(tmp_path)).name == "step_10"


def test_latest_without_checkpoints_starts_fresh(tmp_path) -> None:
    assert resolve_resume_path("latest", str(tmp_path)) is None


def test_an_incomplete_checkpoint_path_is_refused(tmp_path) -> None:
    make_checkpoint(tmp_path, "step_14", complete=False)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume_path(str(tmp_path / "checkpoints" / "step_14"), str(tmp_path))


def test_a_fresh_run_refuses_an_output_dir_with_checkpoints(tmp_path) -> None:
    """Nothing already saved is overwritten or rotated away by an unrelated run."""
    make_checkpoint(tmp_path, "step_200", complete=True)
    with pytest.raises(ArgumentError, match="already holds checkpoints"):
        parse_args(["--output_dir", str(tmp_path)])
    parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])  # continuing it is fine
