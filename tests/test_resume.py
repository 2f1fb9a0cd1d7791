"""Checkpoints resume exactly where they left off, rotate, and bad input stops train.py cleanly."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import MAX_STEPS, launch, read_metrics, split_args, train

RESUME_STEP = 8  # mid-epoch, in the second epoch (6 steps per epoch on `uneven_data`)


def logged(output_dir, first_step: int) -> dict[tuple[int, str], float]:
    """Every logged loss, lr and eval_loss after `first_step`."""
    return {(m["step"], key): m[key] for m in read_metrics(output_dir) if m["step"] > first_step
            for key in ("loss", "lr", "eval_loss") if key in m}


@pytest.mark.parametrize("config", ["single", "ddp", "fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"])
def test_resume_latest_in_a_fresh_launch_continues_exactly(config, cached_run, uneven_data, tmp_path) -> None:
    args = split_args(uneven_data, per_device=8 if config == "single" else 4, accumulation=1)
    full = cached_run(config, *args)
    shutil.copytree(full / "checkpoints" / f"step_{RESUME_STEP}", tmp_path / "checkpoints" / f"step_{RESUME_STEP}")

    result = train(config, tmp_path, *args, "--resume_from_checkpoint", "latest")
    assert f"at step {RESUME_STEP}" in result.stderr
    expected, actual = logged(full, RESUME_STEP), logged(tmp_path, RESUME_STEP)
    assert sorted(step for step, key in actual if key == "loss") == list(range(RESUME_STEP + 1, MAX_STEPS + 1))
    assert actual.keys() == expected.keys()
    for entry in expected:
        assert actual[entry] == pytest.approx(expected[entry], rel=1e-6, abs=1e-7), entry
    final_full, final_resumed = (load_file(d / "final" / "model.safetensors") for d in (full, tmp_path))
    for name in final_full:
        torch.testing.assert_close(final_resumed[name], final_full[name], atol=1e-6, rtol=0, msg=name)


def test_rotation_keeps_the_newest_checkpoints(tmp_path) -> None:
    train("single", tmp_path, "--max_steps", "8", "--eval_steps", "100", "--save_steps", "2", "--save_total_limit", "3")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4", "step_6", "step_8"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resume_from_checkpoint", "/nonexistent/step_3"], "no complete checkpoint at /nonexistent/step_3"),
        (["--block_size", "4096"], "--block_size 4096 exceeds the model's maximum of 128 positions"),
        (["--learnin_rate", "0.1"], "did you mean 'learning_rate'"),
        (["--train_file", "/nonexistent/train.txt"], "data file not found: /nonexistent/train.txt"),
        (["--train_file", "empty.txt"], "data file is empty"),
        (["--train_file", "train.xml"], "unsupported data file type '.xml'"),
    ],
)
def test_bad_input_is_one_clear_line_and_a_nonzero_exit(args, message, tmp_path) -> None:
    for name, content in (("empty.txt", ""), ("train.xml", "<doc/>")):  # placeholders made here
        if name in args:
            (tmp_path / name).write_text(content)
            args = [str(tmp_path / name) if arg == name else arg for arg in args]
    result = launch("ddp", "train.py", "--model_config", "llama-tiny", "--output_dir", str(tmp_path), *args)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split("error: ")[0]


def test_a_non_finite_loss_stops_the_run_before_anything_is_saved(tmp_path) -> None:
    """A learning rate of 1e4 without clipping breaks the tiny model within a few steps."""
    result = launch("ddp", "train.py", "--model_config", "llama-tiny", "--output_dir", str(tmp_path),
                    "--max_steps", "12", "--logging_steps", "1", "--save_steps", "1", "--learning_rate", "1e4",
                    "--max_grad_norm", "0", "--warmup_steps", "0", "--lr_scheduler_type", "constant")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "non-finite (NaN or inf) at step" in errors[0], result.stderr[-3000:]
    bad_step = int(errors[0].split("at step ")[1].split(";")[0])
    logged = [m["loss"] for m in read_metrics(tmp_path) if "loss" in m]
    assert len(logged) == bad_step - 1 and all(map(math.isfinite, logged))  # nothing logged from the bad step on
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved and max(saved) < bad_step  # no checkpoint of poisoned weights
    assert not (tmp_path / "final").exists()
