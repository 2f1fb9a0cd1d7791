"""What ran is what was asked: under bf16, every strategy keeps fp32 master weights (and the
documented gradient-reduction dtype), and
DeepSpeed's effective config (after `prepare`) has no "auto" and train.py's values."""

from __future__ import annotations

import json

import pytest

from tests.conftest import train

# single.yaml runs DDP's code path on one process (the same autocast and torch AdamW).
CONFIGS = ["ddp", "fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload"]


@pytest.mark.parametrize("config", CONFIGS)
def test_bf16_keeps_fp32_master_weights_and_deepspeed_runs_our_values(config: str, tmp_path) -> None:
    result = train(config, tmp_path, "--max_steps", "2", "--eval_steps", "100", "--gradient_accumulation_steps", "2",
                   launcher_args=("--mixed_precision", "bf16"))
    assert "mixed_precision=bf16" in result.stderr
    assert "master weights torch.float32" in result.stderr
    # FSDP2 reduces in fp32 (train.py's policy), as DDP; DeepSpeed in bf16, its communication_data_type default
    reduced = "torch.bfloat16" if config.startswith("deepspeed") else "torch.float32"
    assert f"gradients averaged in {reduced}" in result.stderr

    effective = tmp_path / "deepspeed_config.json"
    assert effective.exists() == config.startswith("deepspeed")
    if effective.exists():
        text = effective.read_text()
        ds = json.loads(text)
        assert '"auto"' not in text
        assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (4, 2, 16)
        assert ds["gradient_clipping"] == 1.0
        assert (ds["bf16"]["enabled"], ds["fp16"]["enabled"]) == (True, False)
