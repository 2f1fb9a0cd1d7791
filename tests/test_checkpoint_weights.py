"""A checkpoint's weights come out whole with scripts/checkpoint_weights.py (what replaces DeepSpeed's
`zero_to_fp32.py` and `accelerate merge-weights` for model_state/), whichever strategy wrote it: full fine-tuning
checkpoints match final/; LoRA checkpoints hold the adapter as one process holds it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

FINAL_STEP = 12  # the strategy runs save their last checkpoint at the final step


def converted(checkpoint, out_dir) -> dict[str, torch.Tensor]:
    """The script's model.safetensors: its `main`, in this process."""
    from scripts.checkpoint_weights import main

    main([str(checkpoint), str(out_dir)])
    return load_file(out_dir / "model.safetensors")


@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"])
def test_the_weights_of_the_last_checkpoint_equal_the_final_export(config, strategy_run, tmp_path) -> None:
    run = strategy_run(config)
    weights = converted(run / "checkpoints" / f"step_{FINAL_STEP}", tmp_path)
    final = load_file(run / "final" / "model.safetensors")
    assert weights.keys() == final.keys()
    for name in final:
        torch.testing.assert_close(weights[name], final[name], atol=0, rtol=0, msg=name)


@pytest.mark.parts("lora", "sft")
@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero3"])
def test_a_lora_checkpoint_holds_the_adapter_gathered_as_one_process_holds_it(config, lora_run, tmp_path) -> None:
    """The sharded checkpoint at step 3 of a LoRA run: every adapter tensor, full-shaped and trained (not the zeros
    LoRA's B starts from), equal to the single-process checkpoint's."""
    reference = converted(lora_run("single") / "checkpoints" / "step_3", tmp_path / "single")
    weights = converted(lora_run(config) / "checkpoints" / "step_3", tmp_path / config)
    adapter = sorted(name for name in reference if ".lora_" in name)
    assert len(adapter) == 2 * 7 * 2  # 2 layers x 7 linear modules (all-linear) x (A, B)
    for name in adapter:
        assert weights[name].shape == reference[name].shape, name
        torch.testing.assert_close(weights[name], reference[name], atol=1e-5, rtol=0, msg=name)
    assert all(weights[name].abs().max() > 0 for name in adapter if ".lora_B." in name)
