"""Checkpoints resume where they left off, rotate, and bad input stops train.py cleanly."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import launch, read_metrics, train

RUN = ["--max_steps", "8", "--logging_steps", "1", "--eval_steps", "100", "--save_steps", "2"]


def train_losses(output_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(output_dir) if "loss" in m}


def test_resume_latest_continues_the_same_run_and_rotation_keeps_the_newest(tmp_path) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train("ddp", full, *RUN, "--save_total_limit", "3")
    kept = sorted(p.name for p in (full / "checkpoints").iterdir())
    assert kept == ["step_4", "step_6", "step_8"]

    shutil.copytree(full / "checkpoints" / "step_4", resumed / "checkpoints" / "step_4")
    result = train("ddp", resumed, *RUN, "--resume_from_checkpoint", "latest")
    assert "resumed from" in result.stderr and "at step 4" in result.stderr
    expected, actual = train_losses(full), train_losses(resumed)
    assert sorted(actual) == [5, 6, 7, 8]
    for step in actual:
        assert actual[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resume_from_checkpoint", "/nonexistent/step_3"], "no complete checkpoint at /nonexistent/step_3"),
        (["--block_size", "4096"], "--block_size 4096 exceeds the model's maximum of 128 positions"),
        (["--learnin_rate", "0.1"], "did you mean 'learning_rate'"),
    ],
)
def test_bad_input_is_one_clear_line_and_a_nonzero_exit(args, message, tmp_path) -> None:
    result = launch("ddp", "train.py", "--model_config", "llama-tiny", "--output_dir", str(tmp_path), *args)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split("error: ")[0]
