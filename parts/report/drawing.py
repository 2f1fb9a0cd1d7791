"""`output_dir/report.png`: training and eval loss, learning rate (each parameter group's, where they differ),
throughput and gradient norm against step, the gradient noise scale where a run measured it (parts/gns), then one
panel per other evaluation metric the run logged (`eval_accuracy`, and any a task adds), drawn from
`output_dir/metrics.jsonl` at the end of every run.

    python -m parts.report.drawing outputs/default      # redraw it for any run directory
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from training.metrics import read_metrics

CORE_PANELS = (  # (title, [(metrics key, label, style)], log scale)
    ("loss", [("loss", "train", "-"), ("eval_loss", "eval", "o-")], True),
    ("learning rate", [("lr", "lr", "-")], False),
    ("throughput (all ranks)", [("tokens_per_sec", "tokens/s", "-"), ("samples_per_sec", "samples/s", "-")], False),
    ("gradient norm (before clipping)", [("grad_norm", "grad norm", "-")], True),
)
LOGGED_PANELS = (  # drawn where the run logged them
    ("gradient noise scale (examples)", [("gradient_noise_scale", "B_simple", "o-")], True),
)


def metric_panels(records: list[dict]) -> tuple:
    """A panel per evaluation metric beyond the loss that the run logged: a task's new metric
    (`Task.eval_metrics`, named eval_*) is drawn with no edit here, beside the same figure of the training steps
    where they log it too (DPO's rewards/accuracies)."""
    logged = {key for record in records for key in record}
    panels = []
    for key in sorted(key for key in logged if key.startswith("eval_") and key != "eval_loss" and not other_pass(key)):
        name = key.removeprefix("eval_")
        if name in logged:
            panels.append((name.replace("_", " "), [(name, "train", "-"), (key, "eval", "o-")], False))
        else:
            panels.append((f"held out: {name.replace('_', ' ')}", [(key, key, "o-")], False))
    return tuple(panels)


def other_pass(key: str) -> str | None:
    """The pass of an evaluation loss on other weights (a part's `around_evaluation`: `eval_ema_loss`, an average of
    the weights), drawn in the loss panel."""
    return found.group(1) if (found := re.fullmatch(r"eval_([a-z0-9]+)_loss", key)) else None


def panels_of(records: list[dict]) -> tuple:
    """Every panel of the report: the core's, another pass's loss beside the loss, each parameter group's rate beside
    `lr` (`lr/<group>`, where their rates differ), the panels of `LOGGED_PANELS` logged, then `metric_panels`."""
    logged = {key for record in records for key in record}
    (loss_title, losses, log_scale), (lr_title, rates, lr_log), *rest = CORE_PANELS
    losses = [*losses, *((key, f"eval ({other_pass(key)})", "s--") for key in sorted(filter(other_pass, logged)))]
    groups = sorted((key for key in logged if key.startswith("lr/")),  # layer_2 before layer_10
                    key=lambda key: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)])
    rates = [*rates, *((key, key.removeprefix("lr/"), "--") for key in groups)]
    return ((loss_title, losses, log_scale), (lr_title, rates, lr_log), *rest,
            *(panel for panel in LOGGED_PANELS if any(key in logged for key, *_ in panel[1]))) + metric_panels(records)


def write_report(output_dir: str | Path, title: str = "") -> Path:
    """Draw the report from the run's metrics.jsonl; returns the PNG's path."""
    from matplotlib.figure import Figure  # here, not at the top: only the main process draws, at the end

    output_dir = Path(output_dir)
    records = read_metrics(output_dir)
    # The object API: no pyplot, no display. Fixed margins: matplotlib's constrained layout
    # takes longer than drawing the panels (0.7 s of 1.5 s at the end of every run).
    panels = panels_of(records)
    columns = (len(panels) + 1) // 2
    figure = Figure(figsize=(6 * columns, 8))
    figure.subplots_adjust(left=0.09 * 2 / columns, right=0.98, bottom=0.07, top=0.9, hspace=0.35, wspace=0.25)
    figure.suptitle(title or str(output_dir))
    grid = list(figure.subplots(2, columns).flat)
    for axes in grid[len(panels):]:
        axes.set_visible(False)
    for axes, (panel, series, log_scale) in zip(grid, panels):
        for key, label, style in series:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                axes.plot(*zip(*points), style, label=label, markersize=4)
        axes.set(title=panel, xlabel="optimizer step")
        axes.grid(alpha=0.3)
        if log_scale and axes.has_data():
            axes.set_yscale("log")
        if len(series) > 1 and axes.has_data():
            axes.legend()
    path = output_dir / "report.png"
    partial = path.with_name(".report.png.tmp")  # a reader never sees half a file
    figure.savefig(partial, dpi=100, format="png")
    os.replace(partial, path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    print(write_report(parser.parse_args().output_dir))
