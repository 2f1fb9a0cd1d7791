"""TrainingArguments-style flags end to end: eval/save intervals, first-step logging, sample limits, overwrite,
and a tokenizer of the user's own (`--tokenizer_name`: a copy of the shipped one in a directory of theirs) with the
end-of-run sample's prompt."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from models.language import SHIPPED_TOKENIZER
from tests.harness import read_metrics, split_args, train
from train import due

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("strategy", "step", "epoch_end", "expected"),
    [("steps", 10, False, True), ("steps", 11, True, False), ("epoch", 11, True, True), ("epoch", 10, False, False),
     ("no", 10, True, False)],
)
def test_an_interval_falls_on_its_steps_or_epoch_ends(strategy, step, epoch_end, expected) -> None:
    assert due(strategy, 5, step, epoch_end) is expected


def test_epoch_intervals_first_step_logging_sample_limits_and_overwrite(cached_run, uneven_data, tmp_path) -> None:
    run = tmp_path / "run"  # a finished run (checkpoints step_4 and step_8, final/, metrics) to start afresh over
    shutil.copytree(cached_run("ddp", *split_args(uneven_data, per_device=4, accumulation=1)), run)
    tokenizer_dir = shutil.copytree(SHIPPED_TOKENIZER, tmp_path / "tokenizer")  # the user's, in a directory of theirs
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tokenizer) == 919 and tokenizer.chat_template  # 917 learned, and the two chat turn markers (--task sft)
    result = train("single", run, "--overwrite_output_dir", "--max_train_samples", "48", "--max_eval_samples", "10",
                   "--num_train_epochs", "2", "--eval_strategy", "epoch", "--save_strategy", "epoch",
                   "--logging_first_step", "--logging_steps", "5", "--per_device_train_batch_size", "8",
                   "--block_size", "32", "--tokenizer_name", str(tokenizer_dir), "--sample_prompt", "The fox")
    assert "sample:          'The fox" in result.stdout  # the end-of-run sample continues --sample_prompt
    assert json.loads((run / "final" / "config.json").read_text())["vocab_size"] == 960  # 919, padded to a multiple of 64
    assert (run / "final" / "tokenizer.json").read_text() == (tokenizer_dir / "tokenizer.json").read_text()
    assert "48 sequences of up to 32 tokens, global batch 8, 6 steps/epoch, training to step 12, 10 examples for evaluation" \
        in result.stderr
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics if "loss" in m] == [1, 5, 10, 12]  # the first step, every 5th, the last
    assert [m["step"] for m in metrics if "eval_loss" in m] == [0, 6, 12]  # the start and each epoch's end
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_12", "step_6"]  # none of the old run's
    assert json.loads((run / "summary.json").read_text())["total_steps"] == 12
