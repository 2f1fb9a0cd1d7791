"""The gradient noise scale (parts/gns): the same value under ddp, fsdp and ZeRO-3 for one split of the global batch,
and within the estimator's noise for another split; the estimator unbiased on known terms; impossible settings
refused in one line; the part built on the public API alone."""

from __future__ import annotations

import json
import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from tests.harness import assert_public_api_only, flag_refusal, read_metrics
from training.errors import StrategyError
from training.parts import Launch, installed
from training.strategy import Strategy

pytestmark = [pytest.mark.parts("gns"), pytest.mark.forked]

STEPS = 8
MEASURED = ("--gns_every", "1", "--max_steps", str(STEPS), "--logging_steps", "1", "--eval_strategy", "no",
            "--save_strategy", "no")
SPLITS = {  # name -> (config, micro-batch, accumulation): a global batch of 8 on 2 processes
    "ddp": ("ddp", "2", "2"), "fsdp": ("fsdp", "2", "2"), "zero3": ("deepspeed_zero3", "2", "2"),
    "ddp 4x1": ("ddp", "4", "1"),  # other splits: micro-batches of 4, and one process accumulating 2 of them
    "single 4x2": ("single", "4", "2", "--gns_every", "2"),  # measuring every other logged step (as users do: 10, 5)
}


@pytest.fixture(scope="module")
def runs(cached_run):
    return {name: cached_run(config, *MEASURED, "--per_device_train_batch_size", micro,
                             "--gradient_accumulation_steps", accumulation, *more)
            for name, (config, micro, accumulation, *more) in SPLITS.items()}


def per_step(run) -> list[float]:
    return [record["gradient_noise_scale"] for record in read_metrics(run) if "gradient_noise_scale" in record]


def test_the_strategies_measure_the_same_noise_scale_for_one_split(runs) -> None:
    values = {name: per_step(runs[name]) for name in ("ddp", "fsdp", "zero3")}
    assert len(values["ddp"]) == STEPS and all(math.isfinite(value) and value > 0 for value in values["ddp"])
    for name in ("fsdp", "zero3"):
        assert values[name] == pytest.approx(values["ddp"], rel=1e-4), name
    summaries = {name: json.loads((runs[name] / "summary.json").read_text()) for name in ("ddp", "fsdp", "zero3")}
    for summary in summaries.values():  # the whole run's, over its 8 measured steps, and the median after warm-up
        assert summary["gradient_noise_scale"] == pytest.approx(summaries["ddp"]["gradient_noise_scale"], rel=1e-4)
        assert summary["steady_gradient_noise_scale"] == pytest.approx(statistics.median(values["ddp"][1:]), rel=1e-4)


@pytest.mark.parametrize("split", ["ddp 4x1", "single 4x2"])
def test_another_split_measures_it_within_the_estimators_noise(split, runs) -> None:
    """Micro-batches of 4 rather than 2, on 2 processes or on one accumulating them: another estimate of the same
    quantity, apart from the first by no more than three standard errors of the two runs' per-step estimates (and
    apart: a split that changed nothing proves nothing)."""
    two, other = per_step(runs["ddp"]), per_step(runs[split])
    whole = {name: json.loads((runs[name] / "summary.json").read_text())["gradient_noise_scale"] for name in ("ddp", split)}
    error = math.sqrt(statistics.variance(two) / len(two) + statistics.variance(other) / len(other))
    measured = STEPS // 2 if "--gns_every" in SPLITS[split] else STEPS
    assert len(other) == measured and 0 < abs(whole[split] - whole["ddp"]) < 3 * error, (whole, error)


def test_the_same_micro_batches_on_one_process_or_two_give_the_same_value(runs) -> None:
    """Micro-batches of 4: two processes each reading one, or one process accumulating both, read the same
    micro-batches, so the same small and big gradients: the processes' factor in the scale is right."""
    def by_step(run) -> dict[int, float]:
        return {record["step"]: record["gradient_noise_scale"] for record in read_metrics(run)
                if "gradient_noise_scale" in record}

    one, two = by_step(runs["single 4x2"]), by_step(runs["ddp 4x1"])
    assert sorted(one) == [2, 4, 6, 8]  # measured at every other step
    assert one == pytest.approx({step: two[step] for step in one}, rel=1e-4)


@pytest.mark.quick
def test_the_estimate_of_known_terms_is_exact() -> None:
    """|G|² = 4 and tr(Σ) = 8, per token: E|G_b|² = 4 + 8/b for micro-batches of b = 2 tokens and a global batch of
    B = 8, in 4 examples of 2 tokens: B_simple = 8/4 = 2 tokens, one example."""
    from parts.gns.noise import NoiseMeter

    def column(*values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)

    ranks = {"gns small": column(2 * 8.0, 2 * 8.0), "gns micro_batches": column(2, 2), "gns inverse_tokens": column(1, 1),
             "gns big": column(5.0, 5.0), "gns inverse_window_tokens": column(1 / 8, 1 / 8), "gns tokens": column(8, 8),
             "gns examples": column(4, 4),
             "gns steps": column(1, 1)}
    assert NoiseMeter.report(None, ranks, 0.0) == {"gradient_noise_scale": pytest.approx(1.0)}
    assert NoiseMeter.report(None, ranks | {"gns steps": column(0, 0)}, 0.0) == {}  # nothing measured: nothing logged
    assert NoiseMeter.report(None, ranks | {"gns big": column(9.0, 9.0)}, 0.0) == {}  # tr(Σ) estimated <= 0
    assert NoiseMeter.report(None, ranks | {"gns small": column(200.0, 200.0)}, 0.0) == {}  # |G|² estimated <= 0


@pytest.mark.quick
def test_the_hooks_read_each_micro_batchs_own_gradient() -> None:
    """A user's model on one process, three micro-batches of 2, 3 and 5 targets scaled as the core's runner scales
    them (each loss sum over the window's targets, times the processes; accelerate divides by the accumulation what
    the core multiplied by it): the meter's sums are the brute-force squared norms of each micro-batch's mean
    gradient and of the window's, with the micro-batches' and the window's token counts."""
    from parts.gns.noise import NoiseMeter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    batches = [(torch.randn(n, 3), torch.randn(n, 1)) for n in (2, 3, 5)]
    window = sum(len(x) for x, _ in batches)

    def loss_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (model(x) - y).pow(2).sum()

    def squared_norm(loss: torch.Tensor) -> float:
        return float(sum(g.pow(2).sum() for g in torch.autograd.grad(loss, list(model.parameters()))))

    small = sum(squared_norm(loss_sum(x, y) / len(x)) for x, y in batches)
    big = squared_norm(sum(loss_sum(x, y) for x, y in batches) / window)
    training = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1, device=torch.device("cpu")),
                               args=SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=3),
                               model=model)
    meter = NoiseMeter(training, every=1)
    meter.start(1)
    for x, y in batches:
        (loss_sum(x, y) / window * len(batches) / len(batches)).backward()
        meter.micro_batch_done(SimpleNamespace(targets=len(x), window_targets=window))
    meter.step_done(1, torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))
    sums = {key.removeprefix("gns "): float(value) for key, value in meter.local(0, 1.0, whole_run=False).items()}
    assert sums["small"] == pytest.approx(small, rel=1e-5) and sums["big"] == pytest.approx(big, rel=1e-5)
    assert sums["inverse_tokens"] == pytest.approx(1 / 2 + 1 / 3 + 1 / 5) and sums["micro_batches"] == 3
    assert sums["inverse_window_tokens"] == pytest.approx(1 / window) and sums["steps"] == 1 and sums["examples"] == 6
    assert meter.local(0, 1.0, whole_run=True)["gns small"] == pytest.approx(small, rel=1e-5)  # the launch's too
    meter.start(2)  # the next measured step, hooked once: the sums do not double
    (loss_sum(*batches[0]) / window).backward()
    meter.micro_batch_done(SimpleNamespace(targets=2, window_targets=window))
    assert float(meter.interval["small"]) == pytest.approx(squared_norm(loss_sum(*batches[0]) / 2), rel=1e-5)


@pytest.mark.quick
def test_impossible_settings_are_refused_in_one_line(monkeypatch) -> None:
    from parts.gns import PART

    assert flag_refusal(["--gns_every", "-1"], {}, monkeypatch).startswith("--gns_every -1: give a step interval >= 1")
    from training.arguments import parse_args

    *_, args = parse_args(["--gns_every", "5"])
    with pytest.raises(StrategyError, match="^--gns_every compares one micro-batch's gradient with the global batch's"):
        PART.check_launch(Launch(args, Strategy.DDP, 1, on_cpu=True))
    PART.check_launch(Launch(args, Strategy.DDP, 2, on_cpu=True))
    *_, evaluation = parse_args(["--gns_every", "5", "--do_train", "false"])
    PART.check_launch(Launch(evaluation, Strategy.DDP, 1, on_cpu=True))  # nothing trains: nothing to measure
    if installed("compression"):
        assert "--gns_every 5 with --ddp_comm_hook is not supported: the global gradient clipping" in flag_refusal(
            ["--gns_every", "5", "--ddp_comm_hook", "power_sgd"], {}, monkeypatch)
    for ranks_per_batch, precision, refusal in [(2, "no", "with tensor parallelism: a group's ranks each hold a slice"),
                                                (1, "fp16", "under fp16: its loss scale multiplies the gradients")]:
        prepared = SimpleNamespace(args=args, ranks_per_batch=ranks_per_batch,
                                   accelerator=SimpleNamespace(mixed_precision=precision))
        with pytest.raises(StrategyError, match=f"^--gns_every {refusal}"):
            PART.after_prepare(prepared)


@pytest.mark.quick
def test_a_forkers_part_needs_the_public_api_alone() -> None:
    assert_public_api_only("gns")
