"""Checkpoints are readable by the peer projects' own tools, and match output_dir/final/.

- DeepSpeed: `python <checkpoint>/zero_to_fp32.py <checkpoint> <out> --safe_serialization`
- FSDP2:     `accelerate merge-weights <checkpoint>/pytorch_model_fsdp_0 <out>`
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO

FINAL_STEP = 12  # the strategy runs save their last checkpoint at the final step


def convert(config: str, checkpoint, out_dir) -> list[str]:
    if config == "fsdp":
        return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights",
                str(checkpoint / "pytorch_model_fsdp_0"), str(out_dir)]
    return [sys.executable, str(checkpoint / "zero_to_fp32.py"), str(checkpoint), str(out_dir), "--safe_serialization"]


@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"])
def test_peer_tool_conversion_equals_the_final_export(config, strategy_run, tmp_path) -> None:
    run = strategy_run(config)
    checkpoint = run / "checkpoints" / f"step_{FINAL_STEP}"
    subprocess.run(convert(config, checkpoint, tmp_path), cwd=REPO, check=True, capture_output=True)
    converted, final = load_file(tmp_path / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert converted.keys() == final.keys()
    for name in final:
        torch.testing.assert_close(converted[name], final[name], atol=0, rtol=0, msg=name)
