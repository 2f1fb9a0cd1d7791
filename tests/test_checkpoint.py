"""Which checkpoints count as complete: `latest` and rotation never see a half-written one."""

from __future__ import annotations

import json

import pytest

from training.arguments import ArgumentError, parse_args
from training.checkpoint import TRAINER_STATE, complete_checkpoints, resolve_resume_path, rotate_checkpoints


pytestmark = pytest.mark.quick  # every test here: the quick tier (pytest -m quick)


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
    with pytest.raises(ArgumentError, match="already holds a run"):
        parse_args(["--output_dir", str(tmp_path)])
    parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])  # continuing it is fine


@pytest.mark.parametrize(("limit", "kept"), [(1, ["step_6"]), (2, ["step_6", "step_8"]), (3, ["step_4", "step_6", "step_8"])])
def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path, limit, kept) -> None:
    """Resumed from step_4 while step_8 of the earlier run remains: the new step_6 survives any limit."""
    for name in ("step_2", "step_4", "step_6", "step_8"):
        make_checkpoint(tmp_path, name, complete=True)
    make_checkpoint(tmp_path, "step_7.tmp", complete=False)  # a save killed halfway is not rotation's business
    rotate_checkpoints(str(tmp_path), tmp_path / "checkpoints" / "step_6", limit)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == sorted([*kept, "step_7.tmp"])
