"""Resuming a checkpoint on a different number of processes (same global batch of 8).

FSDP2 sharded checkpoints (torch distributed checkpoint) reshard on load: 2 -> 1 and
1 -> 2 continue the run. DeepSpeed ZeRO checkpoints are partitioned per rank and cannot
be resumed on another count: train.py stops at once and names the conversion path.
"""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import (
    assert_same_final_weights,
    launch,
    read_metrics,
    split_args,
    split_run_args,
    tracked_run_args,
    train,
    with_processes,
)

RESUME_STEP = 8
TOLERANCE = 1e-5  # a different process count sums gradients in a different order


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 2)])
def test_fsdp_checkpoint_resumes_on_another_number_of_processes(
    saved_on, resumed_on, cached_run, split_run, uneven_data, tmp_path
) -> None:
    configs = {n: with_processes("fsdp", n, tmp_path / "configs") for n in (saved_on, resumed_on)}
    args = {n: split_args(uneven_data, per_device=8 // n, accumulation=1) for n in (saved_on, resumed_on)}
    if saved_on == 2:  # the 2-process run of test_accumulation (2 x 2 x 2: accumulation differs too)
        full, args[2] = split_run("fsdp-2x2x2"), split_run_args(uneven_data, "fsdp-2x2x2")
    else:
        full = cached_run(configs[1], *args[1])
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / f"step_{RESUME_STEP}", resumed / "checkpoints" / f"step_{RESUME_STEP}")

    result = train(configs[resumed_on], resumed, *args[resumed_on], "--resume_from_checkpoint", "latest")
    assert f"strategy=fsdp v2 processes={resumed_on}" in result.stderr
    expected = {m["step"]: m["loss"] for m in read_metrics(full) if "loss" in m and m["step"] > RESUME_STEP}
    actual = {m["step"]: m["loss"] for m in read_metrics(resumed) if "loss" in m}
    assert actual.keys() == expected.keys()
    for step in expected:
        assert actual[step] == pytest.approx(expected[step], abs=TOLERANCE), step
    assert_same_final_weights(full, resumed, atol=TOLERANCE)


def test_deepspeed_checkpoint_on_another_number_of_processes_stops_with_the_conversion_path(
    split_run, uneven_data, tmp_path
) -> None:
    full = split_run("zero2-2x2x2")
    shutil.copytree(full / "checkpoints" / f"step_{RESUME_STEP}", tmp_path / "checkpoints" / f"step_{RESUME_STEP}")
    single = with_processes("deepspeed_zero2", 1, tmp_path / "configs")
    result = launch(single, "train.py", "--model_config", "llama-tiny", "--output_dir", str(tmp_path),
                    *split_args(uneven_data, per_device=8, accumulation=1), "--resume_from_checkpoint", "latest")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "DeepSpeed checkpoint of 2 processes" in errors[0] and "zero_to_fp32.py" in errors[0]
    assert not (tmp_path / "metrics.jsonl").exists() or "loss" not in (tmp_path / "metrics.jsonl").read_text()


def test_resume_with_different_accumulation_keeps_the_windows_aligned(cached_run, uneven_data, tmp_path) -> None:
    """Saved at step 5 of 2x4x1 (test_tracking's run), resumed at 2x2x2 (same global batch): accelerate's saved
    micro-step counter (5, odd) must not shift the windows, or updates would mix two batches."""
    full = cached_run("ddp", *tracked_run_args(uneven_data), fresh=True)  # test_tracking.py's run
    shutil.copytree(full / "checkpoints" / "step_5", tmp_path / "checkpoints" / "step_5")
    train("ddp", tmp_path, *split_args(uneven_data, per_device=2, accumulation=2, save_steps=5),
          "--resume_from_checkpoint", "latest")
    expected = {m["step"]: m["loss"] for m in read_metrics(full) if "loss" in m and m["step"] > 5}
    actual = {m["step"]: m["loss"] for m in read_metrics(tmp_path) if "loss" in m and m["step"] > 5}
    assert actual.keys() == expected.keys()
    for step in expected:
        assert actual[step] == pytest.approx(expected[step], abs=TOLERANCE), step
