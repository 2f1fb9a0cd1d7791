"""Every accelerate config trains for real: 2 CPU processes over gloo (1 for single.yaml), fine-tuning
the suite's base checkpoint on the story corpus (tests/conftest.py `parity_args`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.harness import read_metrics, target_loss, validation_batches
from training.errors import StrategyError
from training.strategy import Strategy, requested_strategy, verify_strategy

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

# config -> (strategy line in the log, wrapper class around the model, the optimizer that steps). Under ZeRO
#            optimizer offload the AdamW update runs on the CPU, as DeepSpeed's vectorised CPU Adam (training/optim.py).
STRATEGIES = {
    "single": ("strategy=single processes=1", "LlamaForCausalLM", "AdamW"),
    "ddp": ("strategy=ddp processes=2 backend=gloo", "DistributedDataParallel", "AdamW"),
    "fsdp": ("strategy=fsdp v2 processes=2 backend=gloo", "FSDPLlamaForCausalLM", "AdamW"),
    "deepspeed_zero1": ("strategy=deepspeed ZeRO-1 processes=2 backend=gloo", "DeepSpeedEngine", "AdamW"),
    "deepspeed_zero2": ("strategy=deepspeed ZeRO-2 processes=2 backend=gloo", "DeepSpeedEngine", "AdamW"),
    "deepspeed_zero3": ("strategy=deepspeed ZeRO-3 processes=2 backend=gloo", "DeepSpeedEngine", "AdamW"),
    "deepspeed_zero3_offload": (
        "strategy=deepspeed ZeRO-3 offload=cpu processes=2 backend=gloo", "DeepSpeedEngine", "DeepSpeedCPUAdam"),
}


@pytest.mark.parametrize("config", sorted(STRATEGIES))
def test_config_trains_with_the_strategy_it_names(config: str, strategy_run, tmp_path) -> None:
    strategy_line, wrapper, optimizer = STRATEGIES[config]
    run = strategy_run(config)
    log = (run / "launch.log").read_text()
    assert strategy_line in log
    assert f"model wrapped as {wrapper}; optimizer {optimizer} (--optim adamw_torch_fused)" in log

    metrics = read_metrics(run)
    losses = [m["loss"] for m in metrics if "loss" in m]
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 13))
    assert losses[-1] < losses[0] - 0.5, losses
    assert evals[-1] < evals[0] - 0.5, evals
    assert all({"lr", "grad_norm", "tokens_per_sec"} <= m.keys() for m in metrics if "loss" in m)
    assert all("perplexity" in m for m in metrics if "eval_loss" in m)

    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_12", "step_6"]  # no .tmp left
    for step in (6, 12):
        checkpoint = run / "checkpoints" / f"step_{step}"
        assert json.loads((checkpoint / "trainer_state.json").read_text())["strategy"] == config  # what wrote it
        assert (checkpoint / "model_state" / "rank0.safetensors").is_file()  # the same format for every one

    final = run / "final"
    assert (final / "model.safetensors").is_file()
    assert not [p.name for p in final.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]  # safetensors only
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)  # full, not a shard
    # The export is the trained model, gathered correctly: it reproduces the final eval loss.
    assert target_loss(model.eval(), validation_batches(tmp_path)) == pytest.approx(evals[-1], abs=1e-4)
    prompt = tokenizer("Once upon a time", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8
    assert "sample:" in log and "final eval:" in log


@pytest.mark.quick
@pytest.mark.parametrize(
    ("launch_env", "expected"),
    [({}, Strategy.SINGLE),  # single.yaml: accelerate runs train.py directly
     ({"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "1"}, Strategy.DDP),  # ddp.yaml --num_processes 1: torchrun, DDP of one
     ({"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "2"}, Strategy.DDP),
     ({"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "1", "ACCELERATE_USE_FSDP": "true"}, Strategy.FSDP),
     ({"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "1", "ACCELERATE_USE_DEEPSPEED": "true"}, Strategy.DEEPSPEED)],
)
def test_the_launch_environment_names_the_strategy(monkeypatch, launch_env, expected) -> None:
    for key in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    for key, value in launch_env.items():
        monkeypatch.setenv(key, value)
    assert requested_strategy() is expected


@pytest.mark.quick
@pytest.mark.parametrize(("processes", "accepted"), [(1, True), (2, False)])
def test_one_gpu_ddp_process_runs_the_plain_model(monkeypatch, processes, accepted) -> None:
    """On a GPU accelerate wraps a single MULTI_GPU process in no DDP: that is DDP of one, not a mismatch."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    one_gpu = SimpleNamespace(num_processes=processes, distributed_type=DistributedType.MULTI_GPU)
    if accepted:
        assert verify_strategy(one_gpu, torch.nn.Linear(2, 2)) is Strategy.DDP
    else:
        with pytest.raises(StrategyError, match="wrapped for single"):
            verify_strategy(one_gpu, torch.nn.Linear(2, 2))


@pytest.mark.quick
def test_the_parameters_a_library_cannot_shard_are_named_and_a_layout_that_cannot_keep_them_whole_refused() -> None:
    """FSDP2 refuses a 0-dim parameter and cannot put float64 beside float32 in one unit: both are kept whole
    (training/strategy/whole.py; trained under every config by tests/test_resume_matrix.py). Where they cannot be
    kept whole (rank 0 alone builds the model; several data-parallel dimensions), one line before `prepare`."""
    from training.strategy.whole import _ignored_by_fsdp, unshardable
    from tests.odd_shapes import OddShapes

    model = OddShapes(vocab_size=11)
    assert sorted(unshardable(model, one_dtype=True)) == ["scale64", "temperature"]
    assert sorted(unshardable(model, one_dtype=False)) == ["temperature"]  # (bf16: accelerate makes them all float32)
    whole = unshardable(model, one_dtype=True)
    plugin = SimpleNamespace(cpu_ram_efficient_loading=True, ignored_modules=None)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None)
    with pytest.raises(StrategyError, match=r"^fsdp_cpu_ram_efficient_loading broadcasts sharded parameters only, and "
                                            r"FSDP2 cannot shard temperature, scale64 .*set `fsdp_cpu_ram_efficient_loading: false`"):
        _ignored_by_fsdp(accelerator, model, whole)
    plugin.cpu_ram_efficient_loading = False
    accelerator.torch_device_mesh = object()
    accelerator.parallelism_config = SimpleNamespace(fsdp_dim_names=("dp_replicate", "dp_shard"))
    with pytest.raises(StrategyError, match=r"^FSDP2 cannot shard temperature, scale64 .*give each shape \(1,\) and one "
                                            r"dtype, or train with fsdp.yaml"):
        _ignored_by_fsdp(accelerator, model, whole)
