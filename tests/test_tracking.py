"""What a run shows and leaves behind: TensorBoard events, summary.json, one voice on the console (report.png:
tests/test_report.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.harness import TRACKED_RUN, read_metrics, tracked_run_args, train
from training.arguments import parse_args
from training.errors import ArgumentError
from training.metrics import resolve_trackers

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


@pytest.fixture(scope="module")
def tracked_args(uneven_data) -> tuple[str, ...]:
    """2-process DDP, 10 steps, eval every 5, checkpoints at 5 and 10, TensorBoard on."""
    return tracked_run_args(uneven_data)


@pytest.fixture(scope="module")
def tracked(cached_run, tracked_args) -> Path:
    return cached_run("ddp", *tracked_args, fresh=True)  # the console as a user sees it: import-time output too


def scalars(output_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(output_dir / "runs" / TRACKED_RUN))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_tensorboard_holds_the_loss_and_the_run_config(tracked) -> None:
    logged = read_metrics(tracked)
    for tag in ("loss", "eval_loss", "lr", "tokens_per_sec"):
        expected, events = [(m["step"], m[tag]) for m in logged if tag in m], scalars(tracked, tag)
        assert [step for step, _ in events] == [step for step, _ in expected]
        assert [value for _, value in events] == pytest.approx([v for _, v in expected], rel=1e-6)
    (config_file,) = (tracked / "runs" / TRACKED_RUN).glob("*/hparams.yml")
    config = yaml.safe_load(config_file.read_text())
    assert (config["strategy"], config["num_processes"], config["global_batch"]) == ("ddp", 2, 8)
    assert (config["learning_rate"], config["model_config"], config["report_to"]) == (3e-3, "llama-tiny", "['tensorboard']")


def test_a_resumed_run_replaces_what_tensorboard_had_after_its_checkpoint(tracked, tracked_args, tmp_path) -> None:
    """The run being resumed logged steps 6 to 10 after the checkpoint it resumes (step 5): they appear once."""
    shutil.copytree(tracked / "runs", tmp_path / "runs")
    shutil.copytree(tracked / "checkpoints" / "step_5", tmp_path / "checkpoints" / "step_5")
    train("ddp", tmp_path, *tracked_args, "--resume_from_checkpoint", "latest")
    losses = scalars(tmp_path, "loss")
    assert [step for step, _ in losses] == list(range(1, 11))
    assert losses == [(step, pytest.approx(value, rel=1e-6)) for step, value in scalars(tracked, "loss")]


def test_every_run_ends_with_a_summary(tracked) -> None:
    summary = json.loads((tracked / "summary.json").read_text())
    assert (summary["strategy"], summary["processes"], summary["steps"], summary["total_steps"]) == ("ddp", 2, 10, 10)
    assert summary["wall_time_s"] > 0 and summary["tokens_per_sec"] > 0
    assert summary["train_loss"] == pytest.approx([m["loss"] for m in read_metrics(tracked) if "loss" in m][-1])
    assert summary["eval_loss"] == pytest.approx(read_metrics(tracked)[-1]["eval_loss"])
    assert set(summary["versions"]) == {"torch", "accelerate", "deepspeed", "transformers", "datasets"}


def test_the_console_has_one_progress_bar_and_one_voice(tracked) -> None:
    log = (tracked / "launch.log").read_text()
    assert "[RANK 0]" in log and "[RANK 1]" not in log  # logs from the main process only
    bars = {line.split(":")[0] for chunk in log.split("\r") for line in chunk.splitlines() if "it/s]" in line or "step/s]" in line}
    assert bars == {"training"}  # one bar: no weight loading/saving or per-rank bars
    assert "loss=" in log and "lr=" in log and "tokens_per_s=" in log and "<00:" in log  # metrics and ETA
    assert "warning" not in log.lower()
    assert "step 5: saved" in log and "state saved in" not in log  # one line per checkpoint, not one per file


@pytest.mark.quick
@pytest.mark.parametrize("tracker", ["wandb", "trackio", "mlflow"])
def test_an_optional_tracker_that_is_not_installed_is_named_with_its_install_command(tracker, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, tracker, None)  # import fails, as when the package is missing
    with pytest.raises(ArgumentError, match=f"--report_to {tracker} needs the {tracker} package.*pip install {tracker}"):
        resolve_trackers(["tensorboard", tracker])
    everything_installed = resolve_trackers(["all"])
    assert "tensorboard" in everything_installed and tracker not in everything_installed


@pytest.mark.quick
@pytest.mark.parametrize(
    ("names", "result"),
    [(["none"], []), (["tensorboard", "tensorboard"], ["tensorboard"]),
     (["tensorbord"], "unknown --report_to"), (["none", "tensorboard"], "cannot be combined")],
)
def test_report_to_values(names, result) -> None:
    if isinstance(result, str):
        with pytest.raises(ArgumentError, match=result):
            resolve_trackers(names)
    else:
        assert resolve_trackers(names) == result


@pytest.mark.quick
@pytest.mark.parametrize(("recipe", "trackers"), [("report_to: tensorboard", ["tensorboard"]),
                                                  ("report_to: [tensorboard]", ["tensorboard"]), ("report_to:", [])])
def test_a_recipe_names_trackers_as_a_string_a_list_or_nothing(recipe, trackers, tmp_path) -> None:
    (tmp_path / "recipe.yaml").write_text(recipe + "\n")
    _, _, args = parse_args(["--config", str(tmp_path / "recipe.yaml"), "--output_dir", str(tmp_path / "out")])
    assert args.report_to == trackers and args.run_name == "out"
