"""The README's walkthroughs work as written: pick a config with the planner, train with a
tracker, find the report picture; and the model-config example builds a model."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from models.configs import NAMED_CONFIGS, build_named_config
from models.language import build_tokenizer
from tests.conftest import REPO, TINY_RUN, launch

README = (REPO / "README.md").read_text()


def code_block_after(marker: str, language: str) -> str:
    """The first ```language block after `marker` in the README."""
    return re.search(rf"{re.escape(marker)}.*?```{language}\n(.*?)```", README, re.DOTALL).group(1)


def test_the_first_hour_plan_train_with_a_tracker_and_open_the_report(tmp_path) -> None:
    plan_line, train_line, tensorboard_line = code_block_after("## Your first hour", "bash").strip().splitlines()

    planner = subprocess.run([sys.executable, *shlex.split(plan_line)[1:]], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert planner.returncode == 0, planner.stderr
    pick = re.search(r"recommended: (accelerate_configs/\S+\.yaml)", planner.stdout).group(1)

    train = shlex.split(train_line)
    assert train[:4] == ["accelerate", "launch", "--config_file", pick]  # the README launches what the planner picks
    output_dir = Path(train[train.index("--output_dir") + 1])
    assert tensorboard_line == f"tensorboard --logdir {output_dir}/runs"
    # The same command, shortened for CI: the tiny model, 6 steps, into a scratch directory.
    args = [*train[train.index("train.py") + 1:], *TINY_RUN, "--max_steps", "6", "--output_dir", str(tmp_path / "run")]
    result = launch(REPO / pick, "train.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]

    events = EventAccumulator(str(tmp_path / "run" / "runs" / "run"))
    events.Reload()
    assert "loss" in events.Tags()["scalars"]
    assert imread(tmp_path / "run" / "report.png").shape == (800, 1200, 4)
    first_hour = README.split("## Your first hour")[1].split("\n## ")[0]
    picture = re.search(r"!\[[^]]*\]\(([^)]+)\)", first_hour).group(1)  # the example report shown there
    assert imread(REPO / picture).shape == (800, 1200, 4)


def test_the_new_architecture_example_builds_and_runs(monkeypatch) -> None:
    configs = dict(NAMED_CONFIGS)  # the example adds to it; the real registry stays as it is
    monkeypatch.setattr("models.configs.NAMED_CONFIGS", configs)
    exec(code_block_after("**A new architecture from scratch**", "python"), {"NAMED_CONFIGS": configs})
    tokenizer = build_tokenizer(None, None)
    model = AutoModelForCausalLM.from_config(build_named_config("qwen2-small", tokenizer))
    logits = model(input_ids=torch.tensor([tokenizer("Once upon a time").input_ids])).logits
    assert logits.shape[-1] == model.config.vocab_size >= len(tokenizer)
