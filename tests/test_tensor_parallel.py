"""parts/tensor_parallel: accelerate_configs/fsdp_tp.yaml, FSDP2 x tensor parallelism (dp_shard 2 x tp 2), for
real on 4 CPU processes: the same losses as FSDP2 alone with the same global batch.

Not on 2 processes: FSDP2 needs dp_shard_size >= 2 beside tp_size 2 (accelerate's
parallelism_config.py refuses it; train.py's one-line error is checked below).
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from parts.tensor_parallel.slicing import tensor_parallel_plan
from tests.harness import GLOBAL_BATCH, read_metrics, tiny_resnet
from tests.test_bad_input import FSDP_TP
from training.arguments import parse_args
from training.errors import StrategyError
from training.parts import Launch
from training.strategy import requested_strategy
from training.strategy.accelerator import check_launch

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

GRID_CASES = {  # case -> (environment from accelerate launch, what the error line says)
    "fsdp_tp.yaml launched on fewer processes than its grid": (
        {**FSDP_TP, "WORLD_SIZE": "2"}, "parallelism_config is dp_shard 2 x tp 2 = 4 processes but 2 were launched"),
    "tensor parallelism over every process, nothing left for FSDP2": (
        {**FSDP_TP, "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "WORLD_SIZE": "2"}, "needs parallelism_config_dp_shard_size >= 2"),
    "a grid under DDP": ({**FSDP_TP, "ACCELERATE_USE_FSDP": "false"}, "parallelism_config in the accelerate yaml needs "
                         "distributed_type: FSDP"),
}


@pytest.mark.quick
@pytest.mark.parametrize(("environment", "message"), GRID_CASES.values(), ids=GRID_CASES.keys())
def test_a_grid_that_cannot_run_is_refused_before_any_process_group(environment, message, monkeypatch, tmp_path) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StrategyError, match=message):
        check_launch(Launch(parse_args(["--output_dir", str(tmp_path)])[2], requested_strategy(),
                            int(environment["WORLD_SIZE"]), True))


@pytest.mark.quick
def test_a_model_without_a_tensor_parallel_plan_is_refused() -> None:
    with pytest.raises(StrategyError, match="ResNetForImageClassification has no tensor-parallel plan"):
        tensor_parallel_plan(tiny_resnet(), 2)


def test_fsdp_with_tensor_parallelism_trains_like_fsdp(strategy_run) -> None:
    reference = strategy_run("fsdp")  # 2 processes x 3 sequences x 2 micro-batches
    run = strategy_run("fsdp_tp")  # (2 data-parallel x 2 tensor-parallel) x 3 sequences x 2 micro-batches
    log = (run / "launch.log").read_text()
    assert "strategy=fsdp v2 processes=4 backend=gloo" in log
    assert "tensor parallel: every layer sliced over tp=2 processes (data-parallel 2)" in log
    assert f"global batch {GLOBAL_BATCH}," in log

    metrics, expected = read_metrics(run), read_metrics(reference)
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 13))
    for ours, theirs in zip(metrics, expected, strict=True):
        for key in ("loss", "lr", "eval_loss", "eval_accuracy", "grad_norm"):
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (ours["step"], key)
    # Each token counted once, though two ranks process every batch: as many per step as FSDP2 alone
    # counts in the same (padded) batches, not twice that (loose: the rates are per rank, the step time
    # the slowest rank's).
    tokens, fsdp_tokens = ([m["tokens_per_sec"] * m["step_time"] for m in run_metrics if "loss" in m]
                           for run_metrics in (metrics, expected))
    assert tokens == pytest.approx(fsdp_tokens, rel=0.25)

    for step in (6, 12):
        assert (run / "checkpoints" / f"step_{step}" / "model_state" / "rank0.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(run / "final")  # gathered from both dimensions
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 176)
