"""parts/report: every run ends with report.png (the tracked run of tests/conftest.py draws it), with a panel for
every evaluation metric a task logs."""

from __future__ import annotations

import json

import pytest
from matplotlib.image import imread

from parts.report.drawing import CORE_PANELS, metric_panels, panels_of, write_report
from tests.harness import tracked_run_args

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


def test_every_run_ends_with_a_report_picture(cached_run, uneven_data) -> None:
    tracked = cached_run("ddp", *tracked_run_args(uneven_data), fresh=True)  # tests/test_tracking.py's run, shared
    picture = imread(tracked / "report.png")
    assert picture.shape == (800, 1800, 4)  # 18 x 8 inches at 100 dpi: the four core panels and held-out accuracy
    assert len({tuple(pixel) for pixel in picture.reshape(-1, 4)[::97]}) > 20  # curves drawn, not a blank page


@pytest.mark.quick
def test_the_report_draws_a_panel_for_every_metric_a_task_logs(tmp_path) -> None:
    """No panel is hard-coded for a task: any eval_* metric but the loss gets its own, the core's accuracy as a
    part's exact match or a recipe's top-5 accuracy."""
    records = [{"step": 0, "eval_loss": 2.0, "eval_accuracy": 0.1, "eval_top5_accuracy": 0.3},
               {"step": 5, "loss": 1.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 9.0},
               {"step": 5, "eval_loss": 1.0, "eval_accuracy": 0.2, "eval_top5_accuracy": 0.6, "perplexity": 2.7}]
    assert [(title, series) for title, series, _ in metric_panels(records)] == [
        ("held out: accuracy", [("eval_accuracy", "eval_accuracy", "o-")]),
        ("held out: top5 accuracy", [("eval_top5_accuracy", "eval_top5_accuracy", "o-")])]
    trained_too = [*records, {"step": 5, "rewards/accuracies": 0.5}, {"step": 5, "eval_rewards/accuracies": 0.6}]
    assert ("rewards/accuracies", [("rewards/accuracies", "train", "-"), ("eval_rewards/accuracies", "eval", "o-")],
            False) in metric_panels(trained_too)  # a figure the training steps log too: both in one panel (DPO's)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(record) for record in records))
    assert len(CORE_PANELS) == 4 and imread(write_report(tmp_path)).shape == (800, 1800, 4)  # 6 panels, 3 columns
    # another pass's loss (the average of the weights: eval_ema_loss) beside eval_loss, not a panel of its own
    other_pass = [*records, {"step": 5, "eval_ema_loss": 0.9, "eval_ema_accuracy": 0.25}]
    assert [title for title, _, _ in metric_panels(other_pass)] == [
        "held out: accuracy", "held out: ema accuracy", "held out: top5 accuracy"]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(record) for record in other_pass))
    assert imread(write_report(tmp_path)).shape == (800, 2400, 4)  # 7 panels, 4 columns


def test_the_report_draws_each_groups_rate_and_a_measured_noise_scale() -> None:
    """parts/layer_lr's rates beside `lr`, parts/gns's figure in a panel of its own, each only where logged."""
    records = [{"step": 1, "loss": 1.5, "lr": 1e-3, "lr/layer_10": 1e-3, "lr/layer_2": 8e-4, "gradient_noise_scale": 3.0}]
    panels = {title: series for title, series, _ in panels_of(records)}
    assert panels["learning rate"] == [("lr", "lr", "-"), ("lr/layer_2", "layer_2", "--"), ("lr/layer_10", "layer_10", "--")]
    assert panels["gradient noise scale (examples)"] == [("gradient_noise_scale", "B_simple", "o-")]
    assert "gradient noise scale (examples)" not in {title for title, _, _ in panels_of(records[:0])}
