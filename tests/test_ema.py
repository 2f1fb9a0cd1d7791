"""The average of the weights (parts/ema): the same under every config as on one process, resumed under another config
and process count (exactly, where it does not move on), left alone by an update the loss scaler skipped, of the trained
parameters only; and a run that only evaluates (`--do_train false`) scores a checkpoint under another config."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.harness import CONFIGS, REPO, parity_args, read_metrics
from training.checkpoints.tensors import ModelState

pytestmark = [pytest.mark.parts("ema"), pytest.mark.forked]

MULTI_PROCESS_CONFIGS = sorted(path.stem for path in CONFIGS.glob("*.yaml") if path.stem != "single")
TOLERANCE = 1e-5  # as the parity runs' weights (tests/test_parity.py): float rounding of the gradients' sums
ZERO3 = REPO / "ds_configs" / "zero3.json"
PARTITIONED_ABOVE = 5_000  # values: the persistence threshold of `zero3_partitioning_some`


def saved(run: Path, step: int, folder: str = "ema") -> dict[str, torch.Tensor]:
    """A checkpoint's average (or, folder model_state, its weights), whole."""
    with contextlib.ExitStack() as files:
        state = ModelState(run / "checkpoints" / f"step_{step}", files, folder)
        return {name: state.whole(name).value for name in state.shapes}


def logged(run: Path, key: str) -> dict[int, float]:
    return {record["step"]: record[key] for record in read_metrics(run) if key in record}


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=atol, rtol=0, msg=name)


def with_flags(args: tuple[str, ...], **values: str) -> tuple[str, ...]:
    """`args` with the given flags' values replaced (or added)."""
    args = list(args)
    for flag, value in values.items():
        if f"--{flag}" in args:
            args[args.index(f"--{flag}") + 1] = value
        else:
            args += [f"--{flag}", value]
    return tuple(args)


@pytest.mark.parametrize("config", MULTI_PROCESS_CONFIGS)
def test_the_average_is_the_same_under_every_config_as_on_one_process(config: str, strategy_run) -> None:
    """The parity runs keep an average (tests/fixtures/ema.py): at each checkpoint it matches one process's, it is
    evaluated at every evaluation (the start's on the weights themselves), and it is the trained parameters'."""
    reference, run = strategy_run("single"), strategy_run(config)
    for step in (6, 12):
        assert_close(saved(run, step), saved(reference, step), TOLERANCE)
    weights, average = saved(run, 12, "model_state"), saved(run, 12)
    assert set(average) <= set(weights)  # the parameters (no buffer), each once however the config ties or shards
    assert max(float((average[name] - weights[name]).abs().max()) for name in average) > 1e-3  # an average, apart
    ema_loss, loss = logged(run, "eval_ema_loss"), logged(run, "eval_loss")
    assert sorted(ema_loss) == sorted(loss) == [0, 6, 12]
    assert ema_loss[0] == loss[0] and ema_loss[12] != loss[12]
    for step, value in logged(reference, "eval_ema_loss").items():
        assert ema_loss[step] == pytest.approx(value, abs=TOLERANCE)
    if config == "deepspeed_zero3":  # ZeRO-3 holds the parameters under its threshold whole (every one, here)
        threshold = json.loads(ZERO3.read_text())["zero_optimization"]["stage3_param_persistence_threshold"]
        assert max(value.numel() for value in average.values()) < threshold


def zero3_partitioning_some(directory: Path) -> Path:
    """deepspeed_zero3.yaml on 3 processes with a persistence threshold of 5,000 values: the tiny model's embedding
    and MLP weights partitioned, its attention weights (4,096) and norms held whole."""
    directory.mkdir(parents=True, exist_ok=True)
    settings = json.loads(ZERO3.read_text())
    settings["zero_optimization"]["stage3_param_persistence_threshold"] = PARTITIONED_ABOVE
    (ds := directory / "zero3-partitioned.json").write_text(json.dumps(settings))
    launcher = yaml.safe_load((CONFIGS / "deepspeed_zero3.yaml").read_text())
    launcher["deepspeed_config"]["deepspeed_config_file"] = str(ds)
    (config := directory / "deepspeed_zero3-partitioned.yaml").write_text(yaml.safe_dump(launcher | {"num_processes": 3}))
    return config


def test_the_average_resumes_under_another_config_and_process_count(strategy_run, cached_run, base_model,
                                                                    shared_dir) -> None:
    """fsdp's checkpoint at step 6 resumed by ZeRO-3 on 3 processes (odd partitions; some parameters partitioned,
    some held whole), the average moving on and evaluated (swapped into both kinds): step 12's as fsdp's uninterrupted
    run, and exported (--ema_export) as saved; ZeRO-3's resumed by one process with the average held still (updated
    every 1000 steps) and exported: final/ is ZeRO-3's step-6 average, exactly."""
    fsdp, zero3 = strategy_run("fsdp"), strategy_run("deepspeed_zero3")
    three = cached_run(zero3_partitioning_some(shared_dir / "ema"), *with_flags(
        parity_args("deepspeed_zero3", base_model), per_device_train_batch_size="4", gradient_accumulation_steps="1",
        resume_from_checkpoint=str(fsdp / "checkpoints" / "step_6"), ema_export="true"))
    average = saved(three, 12)
    assert min(value.numel() for value in average.values()) < PARTITIONED_ABOVE < max(value.numel() for value in
                                                                                      average.values())
    assert_close(average, saved(fsdp, 12), TOLERANCE)
    final = load_file(three / "final" / "model.safetensors")  # gathered from both kinds, the average swapped in
    assert all(torch.equal(final[name], value) for name, value in average.items())
    assert logged(three, "eval_ema_loss")[12] == pytest.approx(logged(fsdp, "eval_ema_loss")[12], abs=TOLERANCE)

    held = cached_run("single", *with_flags(parity_args("single", base_model), ema_update_every="1000",
                                            ema_export="true", resume_from_checkpoint=str(zero3 / "checkpoints" / "step_6")))
    final, average = load_file(held / "final" / "model.safetensors"), saved(zero3, 6)
    for name, value in average.items():
        assert torch.equal(final[name], value), name
    held_still = saved(held, 12)
    assert all(torch.equal(held_still[name], value) for name, value in average.items())


def test_a_run_that_only_evaluates_scores_a_checkpoint_or_a_model_under_any_config(strategy_run, cached_run,
                                                                                  base_model) -> None:
    """`--do_train false`: ddp's last checkpoint scored under fsdp (another global batch: an evaluation needs none)
    gives the figures ddp logged there, the average's too; the base model scored on one process gives the parity runs'
    step-0 evaluation. Nothing is trained, saved or exported."""
    ddp, single = strategy_run("ddp"), strategy_run("single")
    scored = cached_run("fsdp", "--model_name_or_path", str(base_model), "--do_train", "false", "--ema_decay", "0.8",
                        "--resume_from_checkpoint", str(ddp / "checkpoints" / "step_12"))
    summary = json.loads((scored / "summary.json").read_text())
    assert (summary["steps"], summary["total_steps"], summary["strategy"]) == (0, 12, "fsdp")
    for key in ("eval_loss", "eval_ema_loss"):
        assert summary[key] == pytest.approx(logged(ddp, key)[12], abs=TOLERANCE), key
    assert [record["step"] for record in read_metrics(scored)] == [12]
    assert not (scored / "final").exists() and not (scored / "checkpoints").exists()

    base = cached_run("single", "--model_name_or_path", str(base_model), "--do_train", "false")
    summary = json.loads((base / "summary.json").read_text())
    assert summary["eval_loss"] == pytest.approx(logged(single, "eval_loss")[0], abs=1e-6)
    assert "eval_ema_loss" not in summary and math.isfinite(summary["perplexity"])


@pytest.mark.quick
@pytest.mark.parametrize(("argv", "message"), [
    (["--ema_update_every", "2"], "--ema_update_every is for the average of the weights: add --ema_decay"),
    (["--ema_export"], "--ema_export is for the average of the weights: add --ema_decay"),
    (["--ema_decay", "1.0"], r"--ema_decay must be in \(0, 1\)"),
    (["--ema_decay", "0.9", "--ema_update_every", "0"], r"--ema_update_every >= 1"),
    (["--ema_decay", "0.9", "--ema_export", "--do_train", "false"], "--ema_export with --do_train false: an "
                                                                     "evaluation exports nothing"),
    # (issue 69: reported eval_ema_* equal to the weights' own)
    (["--ema_decay", "0.9", "--do_train", "false"], "--ema_decay with --do_train false evaluates the average a "
                                                    "checkpoint holds, and a model holds none: give "
                                                    "--resume_from_checkpoint"),
    pytest.param(["--ema_decay", "0.9", "--pipeline_parallel_size", "2"],
                 "--ema_decay 0.9 with --pipeline_parallel_size is not supported: pipeline stages keep no average", marks=pytest.mark.parts("pipeline")),
])
def test_settings_the_average_cannot_keep_are_refused(tmp_path, argv, message) -> None:
    from training.arguments import parse_args
    from training.errors import ArgumentError

    with pytest.raises(ArgumentError, match=message):
        parse_args([*argv, "--output_dir", str(tmp_path)])


@pytest.mark.quick
@pytest.mark.parts("pipeline")
def test_an_average_turned_off_is_no_conflict(tmp_path) -> None:
    """`--ema_decay 0` is off, as a switch given as false is: no conflict with pipeline stages."""
    from training.arguments import parse_args

    _, _, args = parse_args(["--ema_decay", "0", "--pipeline_parallel_size", "2", "--output_dir", str(tmp_path)])
    assert args.parts.ema.ema_decay == 0


@pytest.mark.quick
@pytest.mark.parametrize(("held", "argv", "message"), [
    ("metrics.jsonl", [], "--do_train false writes its evaluation to .*'s metrics.jsonl and summary.json, and .* holds "
                          r"a run's \(metrics.jsonl\); give the evaluation another --output_dir"),
    ("checkpoints/step_2/trainer_state.json", [], r"holds a run's \(checkpoints\)"),
    (None, ["--resume_from_checkpoint", "latest"], "'latest' finds nothing; give the checkpoint's path"),
])
def test_an_evaluation_never_writes_over_a_run(tmp_path, held, argv, message) -> None:
    """--do_train false writes metrics.jsonl and summary.json: never into a run's output_dir (resume cuts its
    metrics back to the checkpoint's step, and the summary would replace the run's)."""
    from training.arguments import parse_args
    from training.errors import ArgumentError

    if held:
        (tmp_path / held).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / held).write_text("{}")
    with pytest.raises(ArgumentError, match=message):
        parse_args(["--do_train", "false", *argv, "--output_dir", str(tmp_path)])
    assert not held or (tmp_path / held).read_text() == "{}"


@pytest.mark.quick
def test_a_skipped_update_leaves_the_average_and_the_weights_swap_in_and_back_exactly(monkeypatch) -> None:
    """One process, a prepared model: an update the fp16 loss scaler skipped (NonFiniteGuard's device tensor: an
    infinite gradient norm, a finite loss) leaves the average; a step taken moves it by the decay; evaluating with it
    puts its values in the weights and the trained ones back, bit for bit."""
    from accelerate import Accelerator

    from parts.ema.average import WeightAverage
    from training.step import NonFiniteGuard

    guard = NonFiniteGuard(torch.device("cpu"), loss_scaling=True)
    skipped, taken = guard.update(1, torch.tensor(2.0), torch.tensor(math.inf)), guard.update(2, 2.0, 1.0)
    assert torch.is_tensor(skipped) and bool(skipped) and not bool(taken)
    assert NonFiniteGuard(torch.device("cpu")).update(1, 2.0, math.inf) is False  # no loss scaler: never skipped

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1, bias=False)))
    model[1].weight.requires_grad_(False)  # a frozen parameter: not averaged
    average = WeightAverage(accelerator, model, decay=0.75, after=0, every=1)
    assert sorted(average.shares) == ["0.bias", "0.weight"]

    def step_weights() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    first = step_weights()
    average.update(1, taken)  # ema-pytorch's first call (its count 0, up to update_after_step): a copy
    assert all(torch.equal(average.shares[name].values, first[name].reshape(-1)) for name in average.shares)
    second = step_weights()
    average.update(2, skipped)
    assert all(torch.equal(average.shares[name].values, first[name].reshape(-1)) for name in average.shares)
    average.update(2, taken)
    expected = {name: torch.lerp(first[name], second[name], 0.25) for name in average.shares}
    assert all(torch.equal(average.shares[name].values, expected[name].reshape(-1)) for name in average.shares)
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    with average.swapped_in():
        assert all(torch.equal(model.get_parameter(name), value) for name, value in expected.items())
    assert all(torch.equal(p, trained[name]) for name, p in model.named_parameters())


@pytest.mark.parts("lora", "sft")
def test_under_lora_the_average_is_the_adapters_and_final_holds_it(cached_run, tied_base_model) -> None:
    """A LoRA run (tests/fixtures/lora.py) with --ema_export, saved at its last step: the average holds the adapter's
    parameters only (the base stays frozen), and final/'s adapter is the average, not the adapter as trained."""
    from tests.fixtures.lora import LORA_STEPS, lora_args

    run = cached_run("ddp", *with_flags(lora_args("ddp", tied_base_model), save_steps=str(LORA_STEPS),
                                        ema_decay="0.5", ema_export="true"))
    average, weights = saved(run, LORA_STEPS), saved(run, LORA_STEPS, "model_state")
    assert sorted(average) == sorted(name for name in weights if "lora_" in name)
    exported = load_file(run / "final" / "adapter_model.safetensors")
    assert sorted(exported) == sorted(name.replace(".default", "") for name in average)
    for name, value in average.items():
        assert torch.equal(exported[name.replace(".default", "")], value), name
    assert any(not torch.equal(average[name], weights[name]) for name in average)


ODD_CONFIGS = ("deepspeed_zero1", "deepspeed_zero3", "fsdp")  # fragments, partitions (persistent too), rows


def test_a_model_of_your_own_with_odd_parameters_keeps_the_same_average_under_every_layout(tmp_path) -> None:
    """tests/odd_shapes.py's plain module (a 0-dim parameter, a float64 one, odd sizes) with an average: ZeRO-1's
    fragments, ZeRO-3's partitions and FSDP2's rows (the 0-dim and float64 parameters kept whole) give the same
    evaluation of the average, and final/ (--ema_export) holds the saved average."""
    from tests.harness import SUITE_FLAGS, launch

    runs = {}
    for config in ODD_CONFIGS:
        runs[config] = tmp_path / config
        result = launch(config, "train.py", "--task", "tests.odd_shapes:OddShapesTask", "--max_steps", "4",
                        "--save_steps", "2", "--eval_steps", "2", "--logging_steps", "1",
                        "--per_device_train_batch_size", "2", "--ema_decay", "0.5", "--ema_export",
                        *SUITE_FLAGS, "--output_dir", str(runs[config]))
        assert result.returncode == 0, result.stderr[-3000:]
    reference = logged(runs["fsdp"], "eval_ema_loss")
    assert sorted(reference) == [0, 2, 4]
    for config, run in runs.items():
        for step, value in logged(run, "eval_ema_loss").items():
            assert value == pytest.approx(reference[step], abs=TOLERANCE), (config, step)
        average, final = saved(run, 4), load_file(run / "final" / "model.safetensors")
        assert any(value.dim() == 0 for value in average.values()), config  # the 0-dim parameter is averaged
        for name, value in average.items():
            assert torch.equal(final[name], value.to(final[name].dtype)), (config, name)
