"""What ran is what was asked: under bf16, every strategy keeps fp32 master weights (and the
documented gradient-reduction dtype), and
DeepSpeed's effective config (after `prepare`) has no "auto" and train.py's values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import train
from training.parts import installed

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

# single.yaml runs DDP's code path on one process (the same autocast and torch AdamW). fsdp and
# deepspeed_zero2 run bf16 on the image task (tests/test_images.py: BatchNorm), with the same checks.
CONFIGS = ["ddp", "deepspeed_zero1", "deepspeed_zero3", "deepspeed_zero3_offload"]
BF16 = ("--gradient_accumulation_steps", "2")  # and 4 per device: DeepSpeed's batch settings are (4, 2, 16)


def assert_runs_bf16_as_asked(config: str, output_dir: Path, stderr: str) -> None:
    """fp32 master weights, gradients reduced in the documented dtype, and (DeepSpeed) the effective
    config with our values and no "auto" left."""
    assert "mixed_precision=bf16" in stderr
    assert "master weights torch.float32" in stderr
    # FSDP2 reduces in fp32 (train.py's policy), as DDP; DeepSpeed in bf16, its communication_data_type default
    reduced = "torch.bfloat16" if config.startswith("deepspeed") else "torch.float32"
    assert f"gradients averaged in {reduced}" in stderr

    effective = output_dir / "deepspeed_config.json"
    assert effective.exists() == config.startswith("deepspeed")
    if effective.exists():
        text = effective.read_text()
        ds = json.loads(text)
        assert '"auto"' not in text
        assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (4, 2, 16)
        assert ds["gradient_clipping"] == 1.0
        assert (ds["bf16"]["enabled"], ds["fp16"]["enabled"]) == (True, False)


@pytest.mark.parametrize("config", CONFIGS)
def test_bf16_keeps_fp32_master_weights_and_deepspeed_runs_our_values(config: str, tmp_path) -> None:
    """...and each rank holds the model state the planner predicts for bf16 (counted from the tensors; fp32:
    tests/test_memory_plan.py; ZeRO-2 and FSDP2 in bf16: tests/test_benchmarks.py)."""
    result = train(config, tmp_path, "--max_steps", "2", "--eval_steps", "100", *BF16,
                   launcher_args=("--mixed_precision", "bf16"))
    assert_runs_bf16_as_asked(config, tmp_path, result.stderr)
    measured = json.loads((tmp_path / "summary.json").read_text())
    if installed("memory_plan"):  # the part's planner, against what the run held
        from tests.fixtures.memory_plan import assert_planned_model_state

        assert_planned_model_state(measured, config, "bf16")
