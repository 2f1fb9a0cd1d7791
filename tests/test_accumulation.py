"""Splitting one global batch differently changes nothing, with padded variable-length data.

One global batch of 8 sequences, split as (processes x per-device batch x accumulation):
(1x8x1), (2x4x1), (2x2x2), (1x2x4), plus ZeRO-2 and FSDP2 at (2x2x2) and ZeRO-1 and ZeRO-3 at (2x4x1).
Sequences are single documents of different lengths, padded per batch (`--packing false`),
so micro-batches hold different numbers of real tokens: only a loss averaged over every
real token of the global batch (not a mean of per-batch means) makes the splits agree.

The data also fixes two edge cases:
- 50 training sequences make 6 global batches per epoch plus 2 left over. The incomplete
  last global batch is dropped every epoch (every optimizer step weighs 8 sequences), and
  the runs cross an epoch boundary.
- 13 validation sequences divide by neither 2 processes nor a batch of 4: eval_loss must
  still equal the one-process value, and sharded evaluation (ZeRO-3) must not hang.
"""

from __future__ import annotations

import json

import pytest

from scripts.compare_metrics import compare, worst_difference
from tests.harness import MAX_STEPS, SPLITS, assert_same_final_weights, read_metrics

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

TOLERANCE = 1e-5  # float rounding of differently grouped sums, as in tests/test_parity.py


@pytest.mark.parametrize("name", [name for name in SPLITS if name != "1x8x1"])
def test_every_split_of_the_global_batch_gives_the_same_training(name: str, split_run) -> None:
    reference, run = split_run("1x8x1"), split_run(name)
    # Per-step loss, learning rate at every optimizer step, and eval_loss on uneven validation data.
    worst = worst_difference(compare(reference, run, keys=("loss", "lr", "eval_loss")))
    assert worst.absolute <= TOLERANCE, worst
    assert_same_final_weights(reference, run, atol=TOLERANCE)


@pytest.mark.quick
def test_the_incomplete_last_global_batch_is_dropped(split_run) -> None:
    run = split_run("2x2x2")
    losses = [m for m in read_metrics(run) if "loss" in m]
    assert [m["step"] for m in losses] == list(range(1, MAX_STEPS + 1))
    state = json.loads((run / "checkpoints" / "step_8" / "trainer_state.json").read_text())
    # 48 of 50 sequences per epoch: 6 steps of 8, so step 8 is the second step of epoch 1.
    assert len(state.pop("run_id")) == 32  # made at the run's start (training/checkpoints/)
    model = state.pop("model")  # what the model is: a resume into another is refused
    assert model["config"]["hidden_size"] == 64 and "settings" not in model  # (a block size is a data setting)
    flags = state.pop("flags")  # every flag's value: a resume honours or refuses each one changed
    assert (flags["block_size"], flags["gradient_accumulation_steps"], flags["learning_rate"]) == (64, 2, 3e-3)
    assert state == {"completed_steps": 8, "epoch": 1, "steps_in_epoch": 2, "global_batch": 8, "num_processes": 2,
                     "strategy": "ddp", "layout": {}, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                     "optim": "adamw_torch_fused", "optimizer_groups": 2}
