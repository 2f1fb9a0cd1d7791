"""The part mfu: datasheet peaks by GPU name and dtype, the CPU probe, MFU as the speed meter's figure (at most
100% on CPU, its steady state), and every MFU a run logs recomputable from its figures."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from types import SimpleNamespace

import pytest
import torch

from parts.mfu.peaks import TF32, Mfu, agreed_peak, gpu_peak_flops, measured_matmul_flops
from tests.harness import read_metrics
from tests.test_performance import SHORT_RUN
from training.performance import SpeedMeter

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


def cpu_meter(peak: float) -> SpeedMeter:
    return SpeedMeter(torch.device("cpu"), figures=[Mfu(torch.device("cpu"), flops_per_unit=1e6, peak=peak)])


@pytest.mark.quick
@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0e12),
        ("NVIDIA H100 NVL", torch.float16, 835.5e12),
        ("NVIDIA H100 80GB HBM3", torch.float16, 989.4e12),
        ("NVIDIA H200", torch.float32, 66.9e12),
        ("NVIDIA H200 NVL", torch.bfloat16, 835.5e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0e12),
        ("Tesla T4", torch.bfloat16, None),  # not in the table: no MFU rather than a wrong one
    ],
)
def test_gpu_peaks_come_from_the_datasheet_table(name, dtype, peak) -> None:
    assert gpu_peak_flops(name, dtype) == peak


@pytest.mark.quick
def test_the_cpu_peak_is_measured() -> None:
    assert 1e8 < measured_matmul_flops(torch.float32, seconds=0.1) < 1e14


@pytest.mark.quick
@pytest.mark.parametrize(("probed_peak", "mfu"), [(1e9, 0.5), (1e8, 1.0)])  # a probe slowed 10x by another process
def test_cpu_mfu_never_exceeds_100_percent(probed_peak, mfu) -> None:
    speed = cpu_meter(probed_peak)
    speed.units, speed.steps, speed.seconds = 500, 1, 1.0  # 500 tokens/s x 1e6 FLOPs = 5e8 FLOP/s
    one_rank = {name: torch.tensor([value], dtype=torch.float64) for name, value in speed.interval().items()}
    assert speed.report(one_rank)["mfu"] == pytest.approx(mfu)


@pytest.mark.quick
def test_mfu_counts_tf32_runs_against_the_tensor_core_peak() -> None:
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", TF32) == 494.7e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", TF32) == 156.0e12


@pytest.mark.quick
def test_the_cpu_probe_draws_nothing_from_the_global_rng() -> None:
    """A resumed run probes the CPU's FLOP/s after restoring the global RNG (which dropout draws from), as an
    uninterrupted run did long before: drawing from it would change the resumed run's dropout masks."""
    state = torch.get_rng_state()
    measured_matmul_flops(torch.float32, size=64, seconds=0.01)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.quick
@pytest.mark.parametrize(("own", "everyone", "on_cpu", "agreed"), [
    (0.0, [2e11, 0.0], True, 2e11),  # CPU: the main process's probe, for every rank
    (989.4e12, [989.4e12, 312.0e12], False, 989.4e12),  # GPUs: each its own datasheet figure (the report sums them)
    (989.4e12, [989.4e12, 0.0], False, None),  # one rank's GPU not in the table: no rank counts MFU
])
def test_every_rank_decides_alike_whether_it_counts_mfu(own, everyone, on_cpu, agreed) -> None:
    """Each rank must log the same figures (one gather by position): a peak unknown on one rank is unknown on all."""
    assert agreed_peak(own, torch.tensor(everyone, dtype=torch.float64), on_cpu) == agreed


@pytest.mark.quick
def test_a_task_without_flops_gets_no_mfu_and_the_log_says_why(caplog) -> None:
    from accelerate import Accelerator

    from parts.mfu import PART
    from training.parts import Training

    accelerator = Accelerator(cpu=True)  # one process: the probe's gather is its own figure

    def training(flops_per_unit: float | None) -> Training:
        return Training(accelerator, None, SimpleNamespace(flops_per_unit=flops_per_unit), None, None)

    with caplog.at_level(logging.INFO):
        assert PART.logged_figures(training(None)) is None
    assert "no MFU: the task's FLOPs per unit are unknown" in caplog.text
    figures = PART.logged_figures(training(1e6))
    assert isinstance(figures, Mfu) and 1e8 < figures.peak < 1e14


@pytest.mark.quick
def test_steady_mfu_is_the_median_of_the_intervals_after_the_first() -> None:
    speed = cpu_meter(1e12)
    for rate in (10.0, 400.0, 100.0, 300.0):  # the first interval: compilation
        speed.units, speed.steps, speed.seconds = rate, 1, 1.0
        speed.report_interval({name: torch.tensor([value]) for name, value in speed.interval().items()})
    assert speed.steady_state()["steady_mfu"] == pytest.approx(300.0 * 1e6 / 1e12)


def test_every_mfu_a_run_logs_is_recomputable_from_its_figures(cached_run) -> None:
    """The run of tests/test_performance.py: each interval's MFU is its tokens/s x the FLOPs per token over the
    peak logged beside it; the steady state leaves out the first interval."""
    run = cached_run("ddp", *SHORT_RUN)
    steps = [m for m in read_metrics(run) if "loss" in m]
    summary = json.loads((run / "summary.json").read_text())
    assert 0 < summary["mfu"] < 1
    for m in steps:
        assert m["mfu"] == pytest.approx(m["tokens_per_sec"] * summary["flops_per_token"] / m["peak_flops"], rel=1e-6)
    assert summary["steady_mfu"] == pytest.approx(statistics.median(m["mfu"] for m in steps[1:]))


@pytest.mark.parts("benchmarks")
def test_the_mfu_table_recomputes_every_figure_from_what_train_py_logged(tmp_path) -> None:
    """On CPU: the tiny shape at GPT-2's vocabulary, then at the tokenizer's vocabulary, with --train_flags. Each
    figure is a median over the intervals each run logged after its first, MFU recomputed here from the logged
    tokens/s and peak FLOP/s, and FLOPs per token are 6N + 12·L·d·T of the model built here."""
    from tests.test_benchmarks import assert_figures_follow_the_logged_intervals, run_benchmark  # (the part's)

    figures = run_benchmark(tmp_path, "--mfu", "--configs", "fsdp", "--block_sizes", "32", "--steps", "4",
                            "--log_every", "1", "--train_flags=--max_steps 5")  # added flags come last: they win
    assert "; train.py flags added: --max_steps 5" in figures["table"]
    rows = figures["mfu"]
    assert [(row["config"], row["compiled"], row["vocabulary"], row["block_size"]) for row in rows] == [
        ("fsdp", False, 50304, 32), ("fsdp", False, None, 32)]
    for row in rows:
        length, intervals = row["block_size"], row["intervals"]
        assert [m["step"] for m in intervals] == [2, 3, 4, 5]  # the first interval (step 1) is the warm-up
        vocabulary = assert_figures_follow_the_logged_intervals(row, intervals, length, row["vocabulary"])
        assert row["train_py_steady_mfu"] == pytest.approx(row["mfu"])  # train.py's summary.json: the same median
        for m in intervals:  # one process: the tokens of one micro-batch per step
            assert m["tokens_per_sec"] == pytest.approx(row["micro_batch"] * length / m["step_time"], rel=1e-6)
        shown = f"{vocabulary:,}" + ("" if row["vocabulary"] else " (tokenizer)")
        assert (f"| fsdp | no | {shown} | {length} | {row['micro_batch']} | {row['tokens_per_sec']:,.0f} | "
                f"{row['step_time'] * 1000:,.1f} | {row['mfu']:.1%} | {row['whole_run_mfu']:.1%} | "
                f"{row['peak_memory_gb']:.2f} | {row['final_loss']:.3f} |" in figures["table"])
        assert row["micro_batch"] == 4 and row["peak_memory_gb"] > 0
        assert row["torch_compile"] is False  # an eager row ran eager (it passes --torch_compile false)
    assert vocabulary == 960  # the last row: what the default tokenizer gives


@pytest.mark.quick
@pytest.mark.parts("compile")
@pytest.mark.parametrize(("train_flags", "eager_only", "rows"), [
    ("", False, [("ddp", False), ("ddp", True), ("fsdp", False), ("ddp", True)]),
    ("--torch_compile_mode max-autotune-no-cudagraphs", False, [("ddp", True), ("ddp", True)]),
    ("--fused_linear_cross_entropy", True, [("ddp", False), ("fsdp", False), ("ddp", False)]),
], ids=["every row", "a compile option", "eager only"])
def test_the_mfu_rows_follow_the_train_flags(train_flags: str, eager_only: bool, rows: list, tmp_path) -> None:
    """`--train_flags="--torch_compile_mode ..."` compiles every run: the eager rows would be mislabelled, so only the
    compiled ones run; `--eager_only` leaves the compiled rows out (levers --torch_compile refuses). The last row is
    the tokenizer's vocabulary; a compile option's first launch gets it, not a second --torch_compile."""
    from scripts.mfu_benchmark import ANCHOR_VOCABULARY, CPU_DEFAULTS, mfu_rows, mfu_table

    args = argparse.Namespace(**CPU_DEFAULTS | {"configs": ["ddp", "fsdp"], "num_processes": 1, "block_sizes": [64],
                                                "no_tokenizer_row": False, "train_flags": train_flags,
                                                "eager_only": eager_only})
    planned = mfu_rows(args)
    assert [(config, compiled) for config, compiled, _, _ in planned] == rows
    assert [vocabulary for _, _, vocabulary, _ in planned] == [ANCHOR_VOCABULARY] * (len(rows) - 1) + [None]
    launched = []

    def first_launch_only(config, args, output_dir, flags):
        launched.append((config, flags))
        raise SystemExit("recorded")

    with pytest.raises(SystemExit, match="recorded"):
        mfu_table(args, tmp_path, first_launch_only)
    (config, flags), = launched
    # the row's own switch: a compiled row asks for it, an eager one turns it off (unset, a run of 1,000 steps or
    # more would compile); a compile option in --train_flags is then the only one
    own = [flag for flag in flags if flag.startswith("--torch_compile")]
    assert own == ([train_flags.split()[0]] if train_flags.startswith("--torch_compile") else ["--torch_compile"])
    after = flags[flags.index(own[0]) + 1] if flags.index(own[0]) + 1 < len(flags) else None
    assert (after == "false") == (not rows[0][1] and not train_flags.startswith("--torch_compile"))
    assert not train_flags or f" {train_flags} " in f" {' '.join(flags)} "
