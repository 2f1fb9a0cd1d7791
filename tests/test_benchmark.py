"""scripts/benchmark.py runs from the README and measures what it claims."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

CONFIGS = ("deepspeed_zero2", "fsdp", "deepspeed_zero3")  # one of each model-state layout in bf16 (DDP's: fp32's)


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("benchmark")
    command = [sys.executable, "scripts/benchmark.py", "--model_config", "llama-tiny", "--configs", *CONFIGS,
               "--steps", "8", "--warmup", "2", "--log_every", "2", "--rounds", "1",
               "--per_device_train_batch_size", "4", "--block_size", "64",
               "--output", str(out / "table.md"), "--json", str(out / "results.json")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {"table": (out / "table.md").read_text(), **json.loads((out / "results.json").read_text())}


def test_every_strategy_gets_a_row_with_real_figures(benchmark) -> None:
    for config in CONFIGS:
        run = benchmark["strategies"][config]
        assert f"| {config} |" in benchmark["table"]
        assert run["processes"] == 2 and run["tokens_per_sec"] > 0 and run["step_time"] > 0
        assert 0 < run["mfu"] < 1 and run["peak_memory_gb"] > 0 and run["time_to_first_step"] > 0
    assert benchmark["train_py_over_raw"] > 0 and benchmark["data_preparation_tokens_per_sec"] > 0


def test_measured_model_state_matches_the_memory_planner(benchmark) -> None:
    """bf16, 2 processes: what each rank holds, counted from its tensors, within 10% of
    scripts/plan_memory.py (fp32, every config: tests/test_memory_plan.py)."""
    for config in CONFIGS:
        run = benchmark["strategies"][config]
        assert run["model_state_bytes"] == pytest.approx(run["planned_bytes"], rel=0.10), config


@pytest.fixture(scope="module")
def fine_tuning(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fine-tuning")
    # one process: the table's code path, at the cost of one process per run (every config trains LoRA: test_fine_tuning.py)
    command = [sys.executable, "scripts/benchmark.py", "--fine_tuning", "--model_config", "llama-tiny", "--configs", "ddp",
               "--num_processes", "1",
               "--steps", "6", "--warmup", "2", "--log_every", "2", "--per_device_train_batch_size", "4",
               "--block_size", "64", "--output", str(out / "table.md"), "--json", str(out / "results.json")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {"table": (out / "table.md").read_text(), **json.loads((out / "results.json").read_text())}


def test_the_fine_tuning_table_sets_lora_against_full_fine_tuning(fine_tuning) -> None:
    """LoRA trains the same model with gradients and optimizer state for the adapter alone."""
    assert "| ddp |" in fine_tuning["table"]
    full, lora = (fine_tuning["fine_tuning"]["ddp"][kind] for kind in ("full", "lora"))
    assert full["tokens_per_sec"] > 0 and lora["tokens_per_sec"] > 0
    full_state, lora_state = full["model_state_bytes_per_rank"], lora["model_state_bytes_per_rank"]
    # the frozen base is still there, sharded alike, and the adapter beside it
    assert full["parameters"] < lora["parameters"] < 1.25 * full["parameters"]
    assert full_state["parameters"] < lora_state["parameters"] < 1.25 * full_state["parameters"]
    for part in ("gradients", "optimizer"):
        assert 0 < lora_state[part] < 0.25 * full_state[part], part
