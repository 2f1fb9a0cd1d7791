"""The figures train.py reports: FLOPs per token, throughput and peak memory (MFU: tests/test_mfu.py)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from transformers import PretrainedConfig, PreTrainedModel

from tests.harness import read_metrics
from training.performance import SpeedMeter, flops_per_token

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


@pytest.mark.quick
def test_flops_per_token_counts_matmul_parameters_and_attention(tiny_model) -> None:
    # llama-tiny by hand: vocabulary 960 (917 padded to 64), hidden 64, 2 layers, MLP 176, untied head.
    embedding = head = 960 * 64
    layer = 4 * 64 * 64 + 3 * 64 * 176 + 2 * 64  # attention, MLP, two norms
    total = embedding + 2 * layer + 64 + head
    assert sum(p.numel() for p in tiny_model.parameters()) == total
    # 6 x (all but the input embedding) + 12 x layers x width x sequence length
    assert flops_per_token(tiny_model, seq_len=128) == 6 * (total - embedding) + 12 * 2 * 64 * 128


@pytest.mark.quick
def test_a_custom_model_without_attention_fields_is_counted_as_6n() -> None:
    class TinyConfig(PretrainedConfig):
        model_type = "tiny-custom"

    class TinyCustom(PreTrainedModel):  # any nn.Module returning logits: its config says nothing of attention
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10)

    model = TinyCustom(TinyConfig())
    assert flops_per_token(model, seq_len=128) == 6 * sum(p.numel() for p in model.parameters())


@pytest.mark.quick
def test_whole_run_figures_leave_out_the_launchs_first_step(monkeypatch) -> None:
    """The first step carries start-up (torch.compile took 50 s of a 60-step run on an H100)."""
    speed, clock = SpeedMeter(torch.device("cpu")), iter([0.0, 50.0, 50.0, 51.0, 51.0, 52.0])
    monkeypatch.setattr("training.performance.time.perf_counter", lambda: next(clock))
    for _ in range(3):
        speed.resume()
        speed.end_step(units=100)
    assert (speed.whole_run()["units_per_sec"], speed.whole_run()["step_time"]) == (100.0, 1.0)
    alone = SpeedMeter(torch.device("cpu"))
    monkeypatch.setattr("training.performance.time.perf_counter", iter([0.0, 4.0]).__next__)
    alone.resume()
    alone.end_step(units=100)
    assert alone.whole_run()["units_per_sec"] == 25.0  # a launch of one step: that step


@pytest.mark.quick
def test_a_steps_clock_runs_from_the_step_before_and_pauses_for_logging(monkeypatch) -> None:
    """Loading a batch is training time: a clock that started at each step lost the device work that ran
    meanwhile (an H200 read 184% MFU under torch.compile). Logging, evaluation and saving are not."""
    speed, clock = SpeedMeter(torch.device("cpu")), iter([0.0, 1.0, 3.0, 10.0, 11.0])
    monkeypatch.setattr("training.performance.time.perf_counter", lambda: next(clock))
    speed.resume()  # 0
    speed.end_step(units=100)  # 1: the launch's first step
    speed.end_step(units=100)  # 3: 2 s, its batch loaded after the step before ended
    speed.resume()  # 10: after evaluating
    speed.end_step(units=100)  # 11: 1 s
    assert speed.whole_run()["step_time"] == 1.5 and speed.whole_run()["units_per_sec"] == pytest.approx(200 / 3)


@pytest.mark.quick
def test_steady_state_is_the_median_of_the_intervals_after_the_first() -> None:
    speed = SpeedMeter(torch.device("cpu"))
    for rate in (10.0, 400.0, 100.0, 300.0):  # the first interval: compilation
        speed.units, speed.steps, speed.seconds = rate, 1, 1.0
        speed.report_interval({name: torch.tensor([value]) for name, value in speed.interval().items()})
    steady = speed.steady_state()
    assert steady == {"steady_tokens_per_sec": 300.0, "steady_step_time": 1.0}  # (a part's figures: test_mfu.py)
    assert SpeedMeter(torch.device("cpu")).steady_state() == {}  # one interval or none: no steady state


def test_a_parts_steady_figure_is_the_median_of_the_intervals_that_logged_it() -> None:
    """A part's figure some intervals leave out (parts/gns measuring every 10th step, logged every 5th) takes the
    median of those that have it, and none where no interval after the first has it."""

    class EveryOther:
        steady, calls = ("measured",), 0

        def local(self, units: int, seconds: float, whole_run: bool) -> dict[str, float]:
            return {}

        def report(self, ranks, units_per_sec: float) -> dict[str, float]:
            self.calls += 1
            return {"measured": float(self.calls)} if self.calls % 2 else {}

    speed = SpeedMeter(torch.device("cpu"), figures=[EveryOther()])
    for _ in range(6):  # intervals 1, 3, 5 measured
        speed.units, speed.steps, speed.seconds = 1, 1, 1.0
        speed.report_interval({name: torch.tensor([value]) for name, value in speed.interval().items()})
    assert speed.steady_state()["steady_measured"] == 4.0  # the median of 3 and 5 (1: the warm-up)
    speed.reported = speed.reported[:2]
    assert "steady_measured" not in speed.steady_state()


# 4 steps on DDP, batches loaded by a worker process
# No evaluation: under --torch_compile it would compile a second (inference) graph, and these tests read training figures.
SHORT_RUN = ("--max_steps", "4", "--logging_steps", "1", "--eval_strategy", "no", "--per_device_train_batch_size", "4",
             "--dataloader_num_workers", "1")


def test_every_run_reports_speed_and_memory(cached_run) -> None:
    run = cached_run("ddp", *SHORT_RUN)
    steps = [m for m in read_metrics(run) if "loss" in m]
    assert all({"tokens_per_sec", "step_time", "peak_memory_gb"} <= m.keys() for m in steps)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "ddp" and summary["processes"] == 2 and summary["steps"] == 4
    assert summary["peak_memory_gb"] > 0.1
    assert summary["versions"]["torch"].startswith("2.13.0")
    # the steady state leaves out the first interval
    assert summary["steady_tokens_per_sec"] == pytest.approx(statistics.median(m["tokens_per_sec"] for m in steps[1:]))
    assert not (run / "report.png").exists()  # --report_png false (tests/conftest.py TINY_RUN): the run drew nothing


@pytest.mark.quick
def test_a_model_split_over_gpus_reports_each_gpus_peak() -> None:
    """--device_map: one process, layers on two GPUs; the report names each (peaks as gathered)."""
    speed = SpeedMeter(torch.device("cuda:0"), memory_devices=[torch.device("cuda:0"), torch.device("cuda:1")])
    gathered = {"units_per_sec": torch.tensor([10.0]), "step_time": torch.tensor([0.1]),
                "peak_memory 0": torch.tensor([2.0 * 2**30]), "peak_memory 1": torch.tensor([5.0 * 2**30])}
    report = speed.report(gathered)
    assert report["peak_memory_gb"] == 5.0  # the fullest device
    assert (report["peak_memory_gb_cuda0"], report["peak_memory_gb_cuda1"]) == (2.0, 5.0)
