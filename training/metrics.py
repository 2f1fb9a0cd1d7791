"""Metrics: `output_dir/metrics.jsonl` (one JSON object per line) and accelerate's trackers."""

from __future__ import annotations

import json
from importlib.metadata import version
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


def write_summary(output_dir: str, summary: dict) -> None:
    """`output_dir/summary.json`: the run's final figures, settings and library versions."""
    versions = {name: version(name) for name in ("torch", "accelerate", "deepspeed", "transformers", "datasets")}
    (Path(output_dir) / "summary.json").write_text(json.dumps(summary | {"versions": versions}, indent=2) + "\n")
