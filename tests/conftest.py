"""Shared helpers: real `accelerate launch` runs of train.py on CPU, and small local datasets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
# Small and fast: the tiny model trains a few steps in seconds per process.
TINY_RUN = ["--model_config", "llama-tiny", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
            "--learning_rate", "3e-3", "--warmup_steps", "2"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(config: str, script: str | Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml <script> <args>`, for real."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{config}.yaml"),
               "--main_process_port", str(free_port()), str(script), *args]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def train(config: str, output_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """Run train.py with the tiny model; fail the test with the run's output if it fails."""
    result = launch(config, "train.py", *TINY_RUN, "--output_dir", str(output_dir), *args)
    assert result.returncode == 0, f"train.py failed under {config}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def text_documents() -> list[str]:
    """Enough short documents for a few blocks of 32 tokens."""
    return [f"Document {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(200)]
