"""Resuming a checkpoint under another strategy or number of processes (same global batch of 8): checkpoints hold
the model and optimizer state in one format (training/checkpoints/tensors.py `model_state/`), so a chain of resumes through
every config and 1, 2 and 4 processes continues one process's run; so does a change of accumulation."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.harness import (
    MAX_STEPS,
    assert_same_final_weights,
    launch,
    logged_after,
    parity_args,
    read_metrics,
    split_args,
    train,
    with_processes,
)
from training.parts import installed

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

RESUME_STEP = 8
TOLERANCE = 1e-5  # a different process count sums gradients in a different order


# The chain trains fresh under its first config, saving every step; each later link resumes the previous link's
# checkpoint at the next step and trains on to the end. Every config saves a checkpoint that another resumes, and the
# process count changes 2 -> 1 -> 2, FSDP2 on 1 process among them (and 4 -> 2 -> 4 with tensor parallelism), and
# so does accumulation, at odd steps too: accelerate's saved micro-step counter must not shift the windows.
# (config, processes, per-device batch, accumulation)
TENSOR_PARALLEL = [("fsdp_tp", 4, 4, 1)] if installed("tensor_parallel") else []
CHAIN = [*TENSOR_PARALLEL, ("ddp", 2, 2, 2), ("deepspeed_zero3_offload", 2, 4, 1), ("fsdp", 1, 8, 1),
         ("single", 1, 8, 1), ("deepspeed_zero1", 2, 4, 1), ("fsdp", 2, 2, 2), ("deepspeed_zero3", 2, 4, 1),
         ("deepspeed_zero2", 2, 4, 1), *(TENSOR_PARALLEL or [("ddp", 2, 4, 1)])]


def test_a_chain_of_resumes_through_every_config_continues_one_process_run(split_run, uneven_data, tmp_path) -> None:
    straight = {m["step"]: m["loss"] for m in read_metrics(split_run("1x8x1")) if "loss" in m}
    previous = None
    for step, (config, processes, per_device, accumulation) in enumerate(CHAIN):
        run = tmp_path / f"{step}-{config}"
        if previous:
            shutil.copytree(previous / "checkpoints" / f"step_{step}", run / "checkpoints" / f"step_{step}")
        launched = with_processes(config, processes, tmp_path / "configs") if config == "fsdp" else config
        result = train(launched, run, *split_args(uneven_data, per_device, accumulation, save_steps=1),
                       *(["--resume_from_checkpoint", "latest"] if previous else []))
        if previous:
            (saved_by, saved_on, *_), recorded = CHAIN[step - 1], config.removesuffix("_tp")  # (tp: a layout of fsdp)
            saved = f"{saved_on} process{'es' if saved_on > 1 else ''}"
            reseeded = f"; random generators reseeded from --seed + step {step}" if saved_on != processes else ""
            assert (f"resuming a {saved_by.removesuffix('_tp')} checkpoint of {saved} under {recorded} "
                    f"with {processes}{reseeded}\n" in result.stderr), result.stderr[-3000:]
        logged = {m["step"]: m["loss"] for m in read_metrics(run) if "loss" in m}
        assert sorted(logged) == list(range(step + 1, MAX_STEPS + 1))
        for later, loss in logged.items():
            assert loss == pytest.approx(straight[later], abs=TOLERANCE), (config, later)
        previous = run
    assert_same_final_weights(split_run("1x8x1"), previous, atol=TOLERANCE)


def test_a_checkpoint_of_another_model_is_refused_in_one_line(split_run, uneven_data, tmp_path) -> None:
    """A model whose tensors differ from the checkpoint's stops before any rank trains, even where its configuration's
    change is named on purpose: the line names the first tensor, the fields that differ and the model flags the
    checkpoint was trained with, never a change to allow (which cannot make other shapes load; issue 69)."""
    full = split_run("2x4x1")
    shutil.copytree(full / "checkpoints" / f"step_{RESUME_STEP}", tmp_path / "checkpoints" / f"step_{RESUME_STEP}")
    result = launch("ddp", "train.py", "--model_config", "llama-tiny", "--config_overrides", "num_hidden_layers=3",
                    "--allow_config_changes", "num_hidden_layers", "--output_dir", str(tmp_path),
                    *split_args(uneven_data, per_device=4, accumulation=1), "--resume_from_checkpoint", "latest")
    assert re.search(r"exitcode\s*:\s*2", result.stderr), result.stderr[-3000:]  # each rank's, behind the launcher's 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {tmp_path / 'checkpoints' / f'step_{RESUME_STEP}'} holds another model (model.layers.2."), errors
    assert errors[0].endswith("num_hidden_layers (2 -> 3)); use the --model_config, --config_overrides or "
                              "--model_name_or_path it was trained with (--model_config llama-tiny)"), errors
    assert not (tmp_path / "metrics.jsonl").exists() or "loss" not in (tmp_path / "metrics.jsonl").read_text()


def test_the_templates_model_resumes_under_zero3_on_3_processes(strategy_run, base_model, tmp_path) -> None:
    """ZeRO-3 pads each partition to a multiple of the process count, and 3 divides none of llama-tiny's tensors:
    a checkpoint of one process resumed there stopped in DeepSpeed's `set_full_hp_param` ("start (2732) + length
    (1366) exceeds dimension size (4096)", issue 54). The parity run's (global batch 12) continues one process's run."""
    single = strategy_run("single")
    shutil.copytree(single / "checkpoints" / "step_6", tmp_path / "checkpoints" / "step_6")
    train("deepspeed_zero3", tmp_path, *parity_args("single", base_model), "--per_device_train_batch_size", "4",
          "--gradient_accumulation_steps", "1", "--resume_from_checkpoint", "latest", launcher_args=("--num_processes", "3"))
    expected, resumed = logged_after(single, 6), logged_after(tmp_path, 6)
    assert resumed.keys() == expected.keys() and len(resumed) == 6 * 2 + 1  # loss and lr at steps 7-12, eval at 12
    for entry, value in expected.items():
        assert abs(resumed[entry] - value) <= TOLERANCE, entry
    assert_same_final_weights(single, tmp_path, atol=TOLERANCE)
