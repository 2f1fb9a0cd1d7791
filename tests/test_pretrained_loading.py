"""Fine-tuning a pretrained directory: FSDP2 builds the model on rank 0 only and broadcasts it
(fsdp_cpu_ram_efficient_loading), ZeRO-3 loads it partitioned (deepspeed.zero.Init); both train
exactly as DDP, which builds it whole on every rank (training/strategy/accelerator.py `model_construction`).
The runs are the LoRA runs of tests/test_fine_tuning.py; full fine-tuning from a checkpoint: tests/test_parity.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.configs import build_named_config
from models.language import build_tokenizer
from tests.harness import read_metrics
from training.strategy.adapters import persistent_buffers

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

# config -> what its log says of how the model was built
LOADING = {"ddp": None, "fsdp": "model built on rank 0 only", "deepspeed_zero3": "model built partitioned"}


@pytest.mark.parts("lora", "sft")  # its runs: the LoRA runs
@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero3"])
def test_a_pretrained_model_loads_without_every_rank_holding_it_and_trains_as_ddp(config, lora_run) -> None:
    """The LoRA runs fine-tune a bf16-saved checkpoint with tied embeddings (tests/conftest.py `tied_base_model`)."""
    from tests.fixtures import lora

    log, metrics = (lora_run(config) / "launch.log").read_text(), read_metrics(lora_run(config))
    assert LOADING[config] in log
    ddp = read_metrics(lora_run("ddp"))
    assert LOADING["fsdp"] not in (lora_run("ddp") / "launch.log").read_text()  # DDP builds it whole on every rank
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == lora.LORA_STEPS and losses == pytest.approx([m["loss"] for m in ddp if "loss" in m], abs=1e-5)
    eval_losses = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert eval_losses == pytest.approx([m["eval_loss"] for m in ddp if "eval_loss" in m], abs=1e-5)


@pytest.mark.quick
def test_only_parameters_are_broadcast_so_models_with_saved_buffers_are_named() -> None:
    llama = AutoModelForCausalLM.from_config(build_named_config("llama-tiny", build_tokenizer(None, None)))
    assert persistent_buffers(llama) == []  # rotary tables are not saved
    batch_norm = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert persistent_buffers(batch_norm) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
