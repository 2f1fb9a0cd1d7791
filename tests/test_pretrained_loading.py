"""Fine-tuning a pretrained directory: FSDP2 builds the model on rank 0 only and broadcasts it
(fsdp_cpu_ram_efficient_loading), ZeRO-3 loads it partitioned (deepspeed.zero.Init); both train
exactly as DDP, which builds it whole on every rank (training/accelerator.py `model_construction`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.configs import build_named_config
from models.language import build_tokenizer
from tests.conftest import read_metrics, train
from training.strategy_adapters import persistent_buffers

# config -> what its log says of how the model was built
LOADING = {"ddp": None, "fsdp": "model built on rank 0 only", "deepspeed_zero3": "model built partitioned"}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama saved in bf16, as published checkpoints are, with its tokenizer; its output layer
    is tied to the input embedding, as in many small models (the random-init runs elsewhere are untied)."""
    directory = tmp_path_factory.mktemp("pretrained")
    tokenizer = build_tokenizer(None, None)
    config = build_named_config("llama-tiny", tokenizer)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def fine_tuned(pretrained, tmp_path_factory) -> dict[str, tuple[str, list[dict]]]:
    runs = {}
    for config in LOADING:
        out = tmp_path_factory.mktemp(config)
        result = train(config, out, "--model_name_or_path", str(pretrained), "--max_steps", "3", "--eval_steps", "3",
                       "--logging_steps", "1")
        assert result.returncode == 0, f"{config}:\n{result.stderr[-4000:]}"
        runs[config] = (result.stderr, read_metrics(out))
    return runs


@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero3"])
def test_a_pretrained_model_loads_without_every_rank_holding_it_and_trains_as_ddp(config, fine_tuned) -> None:
    log, metrics = fine_tuned[config]
    assert LOADING[config] in log
    ddp_losses = [m["loss"] for m in fine_tuned["ddp"][1] if "loss" in m]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 3 and losses == pytest.approx(ddp_losses, abs=1e-5)
    eval_losses = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert eval_losses == pytest.approx([m["eval_loss"] for m in fine_tuned["ddp"][1] if "eval_loss" in m], abs=1e-5)


@pytest.mark.quick
def test_only_parameters_are_broadcast_so_models_with_saved_buffers_are_named() -> None:
    llama = AutoModelForCausalLM.from_config(build_named_config("llama-tiny", build_tokenizer(None, None)))
    assert persistent_buffers(llama) == []  # rotary tables are not saved
    batch_norm = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert persistent_buffers(batch_norm) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
