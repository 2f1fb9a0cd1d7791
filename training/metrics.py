"""Metrics: `output_dir/metrics.jsonl`, accelerate's trackers, and the run's summary (`summary.json`, printed too)."""

from __future__ import annotations

import importlib
import json
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from accelerate import Accelerator

from training.errors import ArgumentError

if TYPE_CHECKING:
    from training.tasks import Task

# --report_to name -> its package (tensorboard is pinned in requirements.txt; the others are optional installs)
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


def _installed(package: str) -> bool:
    try:  # importing, not just finding: a broken install must fail here, not mid-run
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def resolve_trackers(names: list[str]) -> list[str]:
    """`--report_to`'s trackers (`all`: those installed); one missing is refused (accelerate would only debug-log)."""
    unknown = [name for name in names if name not in (*TRACKER_PACKAGES, "all", "none")]
    if unknown:
        raise ArgumentError(f"unknown --report_to {unknown}; choose from {[*TRACKER_PACKAGES, 'all', 'none']}")
    if "none" in names:
        if len(names) > 1:
            raise ArgumentError("--report_to none cannot be combined with other trackers")
        return []
    if "all" in names:
        return [name for name, package in TRACKER_PACKAGES.items() if _installed(package)]
    for name in names:
        if not _installed(TRACKER_PACKAGES[name]):
            raise ArgumentError(
                f"--report_to {name} needs the {TRACKER_PACKAGES[name]} package, which is not installed: "
                f"pip install {TRACKER_PACKAGES[name]} (tensorboard is installed and works offline)")
    return list(dict.fromkeys(names))


METRICS_FILE = "metrics.jsonl"


def read_metrics(run: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl, given the run directory or the file."""
    path = Path(run)
    path = path / METRICS_FILE if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def learning_rates(rates: list[float], groups: list[dict]) -> dict[str, float]:
    """`lr`: the first parameter group's rate (--learning_rate as scheduled, unless a part set the groups' rates:
    parts/layer_lr's first is the highest layer that trains); where the groups' rates differ, each as `lr/<group's
    name>` too."""
    named = {f"lr/{group.get('name', index)}": rate for index, (group, rate) in enumerate(zip(groups, rates))}
    return {"lr": rates[0], **(named if len(set(rates)) > 1 else {})}


class MetricsLogger:
    """Any rank may call; the main process appends to metrics.jsonl, emptied by a `fresh` start (a resume cut it
    back to its checkpoint's step: `keep_metrics_until`)."""

    def __init__(self, accelerator: Accelerator, output_dir: str, fresh: bool) -> None:
        self.accelerator = accelerator
        self.path = Path(output_dir) / METRICS_FILE
        if accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if fresh or not self.path.exists():
                self.path.write_text("")

    def log(self, step: int, **values: float) -> None:
        self.accelerator.log(values, step=step)
        if self.accelerator.is_main_process:
            with self.path.open("a") as file:
                file.write(json.dumps({"step": step, **values}) + "\n")


def keep_metrics_until(output_dir: str, step: int) -> None:
    """metrics.jsonl without the records logged after `step` (a resumed run logs them again)."""
    path = Path(output_dir) / METRICS_FILE
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def write_summary(output_dir: str, summary: dict) -> None:
    versions = {name: version(name) for name in ("torch", "accelerate", "deepspeed", "transformers", "datasets")}
    (Path(output_dir) / "summary.json").write_text(json.dumps(summary | {"versions": versions}, indent=2) + "\n")


def print_summary(summary: dict, final_dir: Path, task: Task) -> None:
    """Load the export with plain `transformers` (proving it loads) and show what it does."""
    sample = task.sample(final_dir)
    # bytes of state the parts measured per rank (parts/memory_plan: the model's; parts/distillation: a teacher's)
    held = "".join(f", {key.removesuffix('_bytes_per_rank').replace('_', ' ')} "
                   + (f"{sum(state.values()) / 2**20:,.1f} MiB" if state else "not measured (needs 2 optimizer steps)")
                   for key, state in summary.items() if key.endswith("_state_bytes_per_rank"))
    mfu = f", MFU {summary['mfu']:.1%}" if "mfu" in summary else ""  # (parts/mfu)
    per_device = "".join(f", {key.removeprefix('peak_memory_gb_')} {gb:.2f}" for key, gb in summary.items()
                         if key.startswith("peak_memory_gb_"))
    evaluation, at_start = shown_evaluation(summary), shown_evaluation(summary, at_start=True)
    print(
        "\n===== training summary =====\n"
        f"steps:           {summary['steps']}\n"
        f"{task.unit + '/s:':<17}{summary[f'{task.unit}_per_sec']:,.0f} ({summary['step_time'] * 1000:,.0f} ms/step{mfu})\n"
        f"memory/rank:     peak {summary['peak_memory_gb']:.2f} GiB{per_device}{held}\n"
        f"final eval:      {evaluation or 'none (--eval_strategy no)'}\n"
        + (f"eval at start:   {at_start}\n" if at_start else "") +
        f"model:           {final_dir}\n"
        f"sample:          {sample}")


def print_evaluation(summary: dict, model_name: str) -> None:
    """What a run that only evaluated (--do_train false) measured."""
    print(f"\n===== evaluation summary =====\nmodel:           {model_name} at step {summary['total_steps']}\n"
          f"eval:            {shown_evaluation(summary)}")


def shown_evaluation(summary: dict, at_start: bool = False) -> str:
    """The summary's evaluation figures as the console shows them (those of the step-0 evaluation, `at_start`)."""
    return ", ".join(f"{key.removesuffix('_at_start')} {value:.4f}" for key, value in summary.items()
                     if (key.startswith("eval_") or key.startswith("perplexity")) and key.endswith("_at_start") == at_start)
