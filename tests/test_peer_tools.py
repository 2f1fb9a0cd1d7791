"""Checkpoints are readable by the peer projects' own tools, and match output_dir/final/.

- DeepSpeed: `python <checkpoint>/zero_to_fp32.py <checkpoint> <out> --safe_serialization`
- FSDP2:     `accelerate merge-weights <checkpoint>/pytorch_model_fsdp_0 <out>`

Full fine-tuning checkpoints match final/; LoRA checkpoints hold the adapter as one process does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO

FINAL_STEP = 12  # the strategy runs save their last checkpoint at the final step


def convert(config: str, checkpoint, out_dir, safetensors: bool = True) -> list[str]:
    """The peer tool's command; `safetensors` false for DeepSpeed's torch format (its safetensors writer
    refuses tied weights)."""
    if config == "fsdp":
        return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights",
                str(checkpoint / "pytorch_model_fsdp_0"), str(out_dir)]
    return [sys.executable, str(checkpoint / "zero_to_fp32.py"), str(checkpoint), str(out_dir),
            *(["--safe_serialization"] if safetensors else [])]


@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"])
def test_peer_tool_conversion_equals_the_final_export(config, strategy_run, tmp_path) -> None:
    run = strategy_run(config)
    checkpoint = run / "checkpoints" / f"step_{FINAL_STEP}"
    subprocess.run(convert(config, checkpoint, tmp_path), cwd=REPO, check=True, capture_output=True)
    converted, final = load_file(tmp_path / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert converted.keys() == final.keys()
    for name in final:
        torch.testing.assert_close(converted[name], final[name], atol=0, rtol=0, msg=name)


@pytest.mark.parts("lora", "sft")
@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero3"])
def test_a_lora_checkpoint_holds_the_adapter_gathered_as_one_process_holds_it(config, lora_run, tmp_path) -> None:
    """The sharded checkpoint at step 3 of a LoRA run, converted with the peer's tool: every adapter tensor,
    full-shaped and trained (not the zeros LoRA's B starts from), equal to the single-process checkpoint's."""
    reference = load_file(lora_run("single") / "checkpoints" / "step_3" / "model.safetensors")
    subprocess.run(convert(config, lora_run(config) / "checkpoints" / "step_3", tmp_path, safetensors=config == "fsdp"),
                   cwd=REPO, check=True, capture_output=True)  # the LoRA base has tied embeddings
    converted = (load_file(tmp_path / "model.safetensors") if config == "fsdp"
                 else torch.load(tmp_path / "pytorch_model.bin", weights_only=True))
    adapter = sorted(name for name in reference if ".lora_" in name)
    assert len(adapter) == 2 * 7 * 2  # 2 layers x 7 linear modules (all-linear) x (A, B)
    for name in adapter:
        assert converted[name].shape == reference[name].shape, name
        torch.testing.assert_close(converted[name], reference[name], atol=1e-5, rtol=0, msg=name)
    assert all(converted[name].abs().max() > 0 for name in adapter if ".lora_B." in name)
