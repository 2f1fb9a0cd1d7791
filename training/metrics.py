"""Metrics: `output_dir/metrics.jsonl` (one JSON object per line) and accelerate's trackers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from accelerate import Accelerator


def to_float(value: torch.Tensor | float) -> float:
    """A Python float from a tensor, a DTensor (FSDP2 grad norms) or a number."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


class MetricsLogger:
    """Appends metrics on the main process only; every rank may call it.

    A run that resumes at step k keeps the records up to k and drops later ones (the run it
    continues may have logged past its last checkpoint); a fresh run starts a new file.
    """

    def __init__(self, accelerator: Accelerator, output_dir: str, resumed_step: int | None) -> None:
        self.accelerator = accelerator
        self.path = Path(output_dir) / "metrics.jsonl"
        if accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resumed_step is not None and self.path.exists():
                kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resumed_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, **values: float) -> None:
        self.accelerator.log(values, step=step)
        if self.accelerator.is_main_process:
            with self.path.open("a") as file:
                file.write(json.dumps({"step": step, **values}) + "\n")


class Throughput:
    """This process's tokens per second since the last `rate()` call, and its total."""

    def __init__(self) -> None:
        self.start, self.tokens, self.total_tokens = time.perf_counter(), 0, 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.total_tokens += tokens

    def rate(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        self.start, self.tokens = now, 0
        return rate
