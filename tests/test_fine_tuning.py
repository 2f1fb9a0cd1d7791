"""LoRA fine-tuning of a checkpoint the suite trains first (tests/conftest.py `tied_base_model`), on the
embedded chat set: the same adapter under every config, resumed exactly, exported in peft's format
and merged. (Full fine-tuning under every config: tests/test_parity.py, whose runs fine-tune the
same checkpoint; the answer mask: tests/test_chat_data.py.)"""

from __future__ import annotations

import contextlib
import json
import re
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from scripts.compare_metrics import compare, worst_difference
from tests.fixtures.lora import LORA_STEPS, lora_args
from tests.harness import (
    CONFIGS,
    assert_continues_exactly,
    assert_same_final_weights,
    logged_after,
    read_metrics,
    target_loss,
    train,
    validation_batches,
)
from training.checkpoints.tensors import ModelState

pytestmark = [pytest.mark.parts("sft"), pytest.mark.forked]  # the LoRA part's runs fine-tune on chat data

# fsdp_tp refuses adapters (tests/test_bad_input.py); single is the reference.
LORA_CONFIGS = sorted(path.stem for path in CONFIGS.glob("*.yaml") if path.stem not in ("single", "fsdp_tp"))
TOLERANCE = 1e-5


@pytest.mark.parametrize("config", LORA_CONFIGS)
def test_every_config_trains_the_same_adapter_and_only_the_adapter(config, lora_run) -> None:
    reference, run = lora_run("single"), lora_run(config)
    differences = compare(reference, run, keys=("loss", "lr", "eval_loss", "eval_exact_match"))
    assert len(differences) == LORA_STEPS * 2 + 3 * 2  # loss and lr per step; both evals at 0, 3 and the end
    worst = worst_difference(differences)
    assert worst.absolute <= TOLERANCE, worst
    assert "is_gradient_checkpointing" not in (run / "launch.log").read_text()  # peft's read of a deprecated name
    # Gathered from shards (fp32), and merged into the base in its own dtype, bf16 here: the same up to
    # bf16's rounding (torch's default bf16 tolerance), which a difference in the last fp32 bits can flip.
    for weights, tolerance in (("adapter_model.safetensors", {"atol": TOLERANCE, "rtol": 0}),
                               ("merged/model.safetensors", {})):
        expected, actual = load_file(reference / "final" / weights), load_file(run / "final" / weights)
        assert expected.keys() == actual.keys() and expected
        for name in expected:
            torch.testing.assert_close(actual[name], expected[name], **tolerance, msg=f"{weights}: {name}")
    assert next(iter(load_file(run / "final" / "merged/model.safetensors").values())).dtype == torch.bfloat16

    log = (run / "launch.log").read_text()
    trainable = int(re.search(r"adapter: ([\d,]+) trainable parameters", log).group(1).replace(",", ""))
    adapter = load_file(run / "final" / "adapter_model.safetensors")
    assert trainable == sum(t.numel() for t in adapter.values())
    state = read_summary(run)["model_state_bytes_per_rank"]
    assert 0 < state["gradients"] <= 4 * trainable  # fp32 gradients for the adapter alone, at most
    assert 0 < state["optimizer"] <= 12 * trainable + 1024  # AdamW's two moments (and ZeRO's fp32 copy), no more


# ddp's with LoRA dropout: a resumed run must draw the masks the uninterrupted one drew, to the last bit
# (dropout draws from the global RNG, which a checkpoint restores; nothing else may draw from it in between).
RESUMED = {"ddp": ("--lora_dropout", "0.1"), "fsdp": (), "deepspeed_zero3": ()}


@pytest.mark.parametrize("config", RESUMED)
def test_a_lora_run_resumes_exactly(config, lora_run, tied_base_model, tmp_path) -> None:
    """The checkpoint at step 3 holds the adapter and its optimizer state (gathered from shards under FSDP2
    and ZeRO-3): the resumed run logs what the uninterrupted one did and ends with its adapter."""
    uninterrupted = lora_run(config, *RESUMED[config])
    shutil.copytree(uninterrupted / "checkpoints" / "step_3", tmp_path / "checkpoints" / "step_3")
    train(config, tmp_path, *lora_args(config, tied_base_model, *RESUMED[config]), "--resume_from_checkpoint", "latest")
    assert_continues_exactly(uninterrupted, tmp_path, 3, LORA_STEPS, "adapter_model.safetensors",
                             bit_exact=bool(RESUMED[config]))
    if RESUMED[config]:  # dropout changed the run from step 3: LoRA's B is zero until step 2's update (warmup)
        plain, dropped = ([m["loss"] for m in read_metrics(run) if "loss" in m] for run in (lora_run(config), uninterrupted))
        assert plain[:2] == dropped[:2] and all(a != b for a, b in zip(plain[2:], dropped[2:], strict=True))


def test_a_lora_run_resumes_under_another_strategy(lora_run, tied_base_model, tmp_path) -> None:
    """FSDP2's checkpoint at step 3, resumed under ZeRO-3: the adapter, its optimizer state and the frozen base carry
    over (training/checkpoints/tensors.py `model_state/`); the losses and final adapter are FSDP2's at the parity tolerance."""
    uninterrupted = lora_run("fsdp")
    shutil.copytree(uninterrupted / "checkpoints" / "step_3", tmp_path / "checkpoints" / "step_3")
    result = train("deepspeed_zero3", tmp_path, *lora_args("deepspeed_zero3", tied_base_model),
                   "--resume_from_checkpoint", "latest")
    assert "resuming a fsdp checkpoint of 2 processes under deepspeed_zero3 with 2" in result.stderr
    expected, actual = logged_after(uninterrupted, 3), logged_after(tmp_path, 3)
    assert actual.keys() == expected.keys()
    assert {step for step, key in actual if key == "loss"} == set(range(4, LORA_STEPS + 1))
    for entry in expected:
        assert actual[entry] == pytest.approx(expected[entry], abs=TOLERANCE), entry
    assert_same_final_weights(uninterrupted, tmp_path, atol=TOLERANCE, weights="adapter_model.safetensors")


def test_plain_peft_loads_the_adapter_and_reproduces_the_eval_loss(lora_run, tied_base_model, tmp_path) -> None:
    """final/ under FSDP2 (the anchors' failure case): PeftModel.from_pretrained(base, final/) gives the run's
    last eval loss over the same validation examples; so does the merged model, to its bf16 rounding."""
    run = lora_run("fsdp")
    logged = [m["eval_loss"] for m in read_metrics(run) if "eval_loss" in m][-1]
    base = AutoModelForCausalLM.from_pretrained(tied_base_model, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, run / "final").eval()
    merged = AutoModelForCausalLM.from_pretrained(run / "final" / "merged").eval()
    batches = validation_batches(tmp_path, "sft")
    assert target_loss(adapted, batches) == pytest.approx(logged, abs=TOLERANCE)
    assert target_loss(merged.float(), batches) == pytest.approx(logged, abs=1e-3)  # merged weights rounded to bf16


def read_summary(run) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_frozen_weights_are_saved_as_built_under_deepspeeds_bf16_engine(cached_run, base_model) -> None:
    """DeepSpeed's bf16 engine casts the whole model and keeps fp32 copies of the adapter only: the base weights in
    its checkpoints were bf16-rounded (up to 3.9e-3 off, issue 54). They are the base model's fp32 values now."""
    run = cached_run("deepspeed_zero2", "--task", "sft", "--model_name_or_path", str(base_model), "--use_peft",
                     "--max_steps", "2", "--save_steps", "1", "--eval_strategy", "no",
                     launcher_args=("--mixed_precision", "bf16"))
    base = load_file(base_model / "model.safetensors")
    with contextlib.ExitStack() as files:
        saved = ModelState(run / "checkpoints" / "step_2", files)
        frozen = {name: name.removeprefix("base_model.model.").replace(".base_layer", "") for name in saved.shapes
                  if "lora_" not in name}
        assert sorted(frozen.values()) == sorted(base)
        assert any((base[name] != base[name].bfloat16().float()).any() for name in base)  # bf16 would round them
        for name, base_name in frozen.items():
            assert torch.equal(saved.whole(name).value, base[base_name]), name
