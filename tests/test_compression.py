"""parts/compression (--ddp_comm_hook): compressed gradient all-reduce under the ddp config, its bytes counted, PowerSGD resumed exactly.
(Bytes, tokens/s and losses of every hook side by side: tests/test_benchmarks.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from parts.compression.hooks import (
    POWER_SGD_STATE,
    check_comm_hook,
    load_power_sgd_state_dict,
    orthogonalize_single_matrices_too,
    power_sgd_state_dict,
)
from tests.harness import TINY_RUN, assert_continues_exactly, read_metrics, split_run_args, train
from training.arguments import parse_args
from training.errors import ArgumentError, StrategyError
from training.strategy import Strategy

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

PLAIN_STEPS = 2  # --power_sgd_start_step: steps 1 and 2 all-reduce every gradient, PowerSGD from step 3
POWER_SGD = ("--ddp_comm_hook", "power_sgd", "--power_sgd_start_step", str(PLAIN_STEPS))
SPLIT = "2x2x2"  # 2 processes x 2 sequences x 2 micro-steps: the hook runs on the synchronising micro-step only
RESUME_STEP = 4


@pytest.fixture(scope="module")
def power_sgd_run(cached_run, uneven_data) -> Path:
    return cached_run("ddp", *split_run_args(uneven_data, SPLIT), *POWER_SGD)


def losses(output_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(output_dir) if "loss" in m}


def test_power_sgd_changes_the_update_only_from_its_start_step(power_sgd_run, split_run) -> None:
    """Until --power_sgd_start_step, the same losses as DDP's own all-reduce; after, other (compressed) updates
    that still train: within 5% of uncompressed training at every step (measured: at most 3.3%, rank 1), and
    at least 3/4 of its drop in eval loss (measured: 84%)."""
    compressed, uncompressed = losses(power_sgd_run), losses(split_run(SPLIT))
    for step in range(1, PLAIN_STEPS + 2):  # step 3's loss is measured before PowerSGD's first update
        assert compressed[step] == pytest.approx(uncompressed[step], rel=1e-6), step
    later = range(PLAIN_STEPS + 2, max(compressed) + 1)
    assert any(compressed[step] != pytest.approx(uncompressed[step], rel=1e-6) for step in later)
    for step in later:
        assert compressed[step] == pytest.approx(uncompressed[step], rel=0.05), step
    (start, *_, end), (start_plain, *_, end_plain) = (
        [m["eval_loss"] for m in read_metrics(run) if "eval_loss" in m] for run in (power_sgd_run, split_run(SPLIT)))
    assert start == pytest.approx(start_plain, rel=1e-6) and start - end > 0.75 * (start_plain - end_plain)


def test_power_sgd_sends_low_rank_factors_counted_by_the_hook(power_sgd_run) -> None:
    summary = json.loads((power_sgd_run / "summary.json").read_text())
    gradients = summary["parameters"] * 4  # fp32: what DDP's all-reduce sends per step
    steps = summary["steps"]
    sent = summary["gradient_allreduce_bytes_per_step"] * steps
    compressed_steps = sent - PLAIN_STEPS * gradients
    assert 0 < compressed_steps < 0.1 * gradients * (steps - PLAIN_STEPS)  # llama-tiny, rank 1: about 1/46


def test_power_sgd_resumes_exactly_from_each_ranks_own_state(power_sgd_run, uneven_data, tmp_path) -> None:
    checkpoint = power_sgd_run / "checkpoints" / f"step_{RESUME_STEP}"
    assert [POWER_SGD_STATE.format(rank=rank) for rank in (0, 1)] == sorted(p.name for p in checkpoint.glob("powersgd_*"))
    shutil.copytree(checkpoint, tmp_path / "checkpoints" / checkpoint.name)
    result = train("ddp", tmp_path, *split_run_args(uneven_data, SPLIT), *POWER_SGD, "--resume_from_checkpoint", "latest")
    assert "starts afresh" not in result.stderr
    assert_continues_exactly(power_sgd_run, tmp_path, RESUME_STEP)


def test_power_sgd_resumes_on_another_process_count_at_one_step_on_every_rank(power_sgd_run, uneven_data,
                                                                             tmp_path) -> None:
    """2 processes' checkpoint on 4: the new ranks started at PowerSGD's step 0 while the others restored theirs,
    so they all-reduced uncompressed while the others compressed, and gloo aborted (issue 54). Every rank now takes
    rank 0's step count, generator and warm start, and starts its error feedback afresh, and trains on."""
    checkpoint = power_sgd_run / "checkpoints" / f"step_{RESUME_STEP}"
    shutil.copytree(checkpoint, tmp_path / "checkpoints" / checkpoint.name)
    result = train("ddp", tmp_path, *split_run_args(uneven_data, SPLIT), *POWER_SGD, "--per_device_train_batch_size",
                   "2", "--gradient_accumulation_steps", "1", "--resume_from_checkpoint", "latest",
                   launcher_args=("--num_processes", "4"))
    assert (f"PowerSGD's state was saved by 2 processes: every rank resumes at its step {RESUME_STEP}, with its error "
            "feedback started afresh" in result.stderr), result.stderr[-3000:]
    resumed, went_on = losses(tmp_path), losses(power_sgd_run)
    assert sorted(resumed) == list(range(RESUME_STEP + 1, max(went_on) + 1))
    for step, loss in resumed.items():  # compressed updates of other sums: close, as PowerSGD to plain all-reduce
        assert loss == pytest.approx(went_on[step], rel=0.05), step


@pytest.mark.quick
def test_power_sgd_state_round_trips_through_a_weights_only_file(tmp_path) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    state = PowerSGDState(None, start_powerSGD_iter=2)
    state.iter, state.error_dict, state.p_memory_dict = 7, {0: torch.randn(5)}, {0: torch.randn(3, 1)}
    state.rng.randint(1000)
    torch.save(power_sgd_state_dict(state), tmp_path / "state.pt")
    restored = PowerSGDState(None, start_powerSGD_iter=2)
    load_power_sgd_state_dict(restored, torch.load(tmp_path / "state.pt", weights_only=True))
    assert restored.iter == 7 and torch.equal(restored.error_dict[0], state.error_dict[0])
    assert torch.equal(restored.p_memory_dict[0], state.p_memory_dict[0])
    assert restored.rng.randint(10**9) == state.rng.randint(10**9)  # the next Q draws the same numbers


@pytest.mark.quick
def test_torch_still_needs_the_batched_power_sgd_fix() -> None:
    """torch 2.13's batched hook hands `_orthogonalize` a 2-D matrix it refuses; the fix orthogonalises it in place.
    When the first assertion fails, torch is fixed: drop `orthogonalize_single_matrices_too`."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    matrix = torch.randn(6, 2)
    with pytest.raises(AssertionError):
        powerSGD_hook._orthogonalize(matrix.clone())
    original = powerSGD_hook._orthogonalize
    try:
        orthogonalize_single_matrices_too()
        powerSGD_hook._orthogonalize(matrix)
    finally:
        powerSGD_hook._orthogonalize = original
    torch.testing.assert_close(matrix.T @ matrix, torch.eye(2), atol=1e-5, rtol=0)


REFUSED = {  # (hook, strategy, processes, on CPU) -> what the error says
    "FSDP owns its communication": (("fp16", Strategy.FSDP, 2, False), "this run is fsdp"),
    "DeepSpeed owns its communication": (("power_sgd", Strategy.DEEPSPEED, 2, False), "this run is deepspeed"),
    "nothing to all-reduce on one process": (("fp16", Strategy.DDP, 1, False), "this run is one process"),
    "torch's bf16 hook needs CUDA": (("bf16", Strategy.DDP, 2, True), "--ddp_comm_hook bf16 needs CUDA"),
}


@pytest.mark.quick
@pytest.mark.parametrize(("case", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_a_hook_that_cannot_run_here_is_refused_with_the_fix(case, message) -> None:
    with pytest.raises(StrategyError, match=message):
        check_comm_hook(*case)
    check_comm_hook(case[0], Strategy.DDP, 2, on_cpu=False)  # what the message points to runs


@pytest.mark.quick
@pytest.mark.parametrize(("flags", "message"), [
    (["--power_sgd_rank", "4"], "--power_sgd_rank is for --ddp_comm_hook power_sgd or batched_power_sgd: add one"),
    (["--ddp_comm_hook", "power_sgd", "--power_sgd_start_step", "1"], "--power_sgd_start_step >= 2"),
    (["--ddp_comm_hook", "fp16", "--pipeline_parallel_size", "2"],
     "--ddp_comm_hook with --pipeline_parallel_size is not supported"),
])
def test_power_sgd_flags_that_cannot_work_are_one_line(flags, message, tmp_path) -> None:
    """The part's flag checks (its `check_flags` hook), in train.py's parse of the flags."""
    with pytest.raises(ArgumentError) as refused:
        parse_args([*TINY_RUN, "--output_dir", str(tmp_path), *flags])
    assert message in str(refused.value) and "\n" not in str(refused.value)
