"""The part memory_plan: the model state each rank holds, measured; scripts/plan_memory.py agreeing with measured runs,
the pick it makes, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parts.memory_plan.measured import model_state_bytes, model_state_probe
from parts.memory_plan.planner import pick
from tests.harness import CONFIGS
from tests.test_performance import SHORT_RUN
from training.arguments import TrainArguments
from training.optim import build_optimizer

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

EVERY_CONFIG = sorted(path.stem for path in CONFIGS.glob("*.yaml") if path.stem != "fsdp_tp")  # 4 processes: below
ORDER = ["ddp", "deepspeed_zero1", "deepspeed_zero2", "fsdp", "deepspeed_zero3", "deepspeed_zero3_offload"]


def plan(capsys, *args: str, figures: Path | None = None) -> tuple[int, str, str, dict | None]:
    """The planner's exit code, printed report, error output and JSON figures: its `main`, in this process
    (as a user runs it, the script: tests/test_readme.py). An exception other than the exit would fail the test
    with its traceback."""
    from scripts.plan_memory import main

    try:
        main([*args, *(["--json", str(figures)] if figures else [])])
        code = 0
    except SystemExit as exited:
        code = exited.code
    printed = capsys.readouterr()
    return code, printed.out, printed.err, json.loads(figures.read_text()) if figures and figures.exists() else None


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """`tiny_plan(num_gpus, *flags)`: the planner's figures for the tiny model the strategy runs train, in fp32
    (scripts/plan_memory.py's own functions, in-process; the script as a user runs it: the tests below)."""
    from scripts.plan_memory import parse_args as plan_args
    from scripts.plan_memory import plan as make_plan

    plans: dict[tuple, dict] = {}

    def figures_for(num_gpus: int, *flags: str) -> dict:
        if (num_gpus, *flags) not in plans:
            plans[num_gpus, *flags] = make_plan(plan_args(["--model_config", "llama-tiny", "--num_gpus", str(num_gpus),
                                                           "--mixed_precision", "no", *flags]))
        return plans[num_gpus, *flags]

    return figures_for


@pytest.mark.parametrize(("config", "training"), [(config, "full") for config in EVERY_CONFIG]
                         + [pytest.param("fsdp_tp", "full", marks=pytest.mark.parts("tensor_parallel"))]
                         + [pytest.param(config, "lora", marks=pytest.mark.parts("lora", "sft")) for config in EVERY_CONFIG])
def test_model_state_agrees_with_the_measured_run_within_10_percent(config, training, tiny_plan, strategy_run,
                                                                     lora_run, tied_base_model) -> None:
    """Each config's parameters, gradients and optimizer state per rank, as counted from the
    tensors of a real run (2 processes; 1 for single, 4 for fsdp_tp), against the planner (bf16: test_benchmarks.py);
    full fine-tuning, and a LoRA adapter on the frozen model (`--use_peft`: gradients and optimizer state for the
    adapter alone)."""
    run = strategy_run(config) if training == "full" else lora_run(config)
    measured = json.loads((run / "summary.json").read_text())
    adapter = ["--use_peft", "--model_name_or_path", str(tied_base_model)] if training == "lora" else []  # what it adapts
    plan_for = tiny_plan(measured["processes"] if config != "single" else 2, *adapter)
    planned = plan_for["configs"][config]
    if training == "lora":
        assert plan_for["trainable_parameters"] < plan_for["parameters"] / 4
    assert planned["processes"] == measured["processes"]
    assert plan_for["parameters"] == measured["parameters"]
    for part, value in measured["model_state_bytes_per_rank"].items():
        assert planned[part] == pytest.approx(value, rel=0.10), part


def test_the_pick_is_the_first_config_that_fits_in_the_documented_order(tmp_path, capsys) -> None:
    """Shrinking GPUs move the pick along DDP, ZeRO-1, ZeRO-2, FSDP2, ZeRO-3, offload; if none fits, exit 1."""
    common = ("--model_config", "llama-125m", "--num_gpus", "8", "--per_device_train_batch_size", "2",
              "--block_size", "512")
    code, stdout, _, figures = plan(capsys, *common, figures=tmp_path / "plan.json")
    assert code == 0 and figures["recommended"] == "ddp" and "recommended: accelerate_configs/ddp.yaml" in stdout
    rows = figures["configs"]
    picks = []
    for need in sorted({rows[name]["gpu_total"] for name in ORDER}, reverse=True):  # memory just enough for each
        first_that_fits = next(name for name in ORDER if rows[name]["gpu_total"] <= need)
        picks.append(pick(rows, 8, need))
        assert picks[-1] == first_that_fits
    assert len(set(picks)) >= 3  # the sizes really step through the order
    assert pick(rows, 8, min(row["gpu_total"] for row in rows.values()) * 0.99) is None
    assert pick(rows, 1, rows["single"]["gpu_total"]) == "single"  # one GPU: one process, no DDP wrapper

    too_small = min(row["gpu_total"] for row in rows.values()) / 2**30 / 0.9 * 0.99
    code, stdout, _, figures = plan(capsys, *common, "--gpu_memory_gb", f"{too_small:.6f}", figures=tmp_path / "none.json")
    assert code == 1 and figures["recommended"] is None and "nothing fits" in stdout


def test_a_local_model_directory_is_read_like_a_hub_id(tmp_path, capsys, strategy_run) -> None:
    exported = strategy_run("ddp") / "final"  # what train.py exports, or any save_pretrained directory
    code, stdout, stderr, figures = plan(capsys, "--model_name_or_path", str(exported), "--num_gpus", "2",
                                         figures=tmp_path / "plan.json")
    assert code == 0, stderr
    assert figures["parameters"] == json.loads((strategy_run("ddp") / "summary.json").read_text())["parameters"]
    assert f"train.py --model_name_or_path {exported}" in stdout


@pytest.mark.quick
@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: (d / "broken.yaml").write_text("distributed_type: [DEEPSPEED\n"), "is not valid YAML"),
        (lambda d: (d / "zero.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                                "  deepspeed_config_file: missing.json\n"), "which does not exist"),
        (lambda d: None, "no accelerate configs"),
    ],
    ids=["malformed yaml", "missing DeepSpeed JSON", "empty configs directory"],
)
def test_bad_configs_are_one_clear_line(setup, message, tmp_path, capsys) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    setup(configs)
    code, _, stderr, _ = plan(capsys, "--model_config", "llama-tiny", "--configs_dir", str(configs))
    assert code == 2 and stderr.startswith("error: ") and message in stderr and stderr.count("\n") == 1


@pytest.mark.quick
def test_a_model_that_needs_its_own_code_is_one_clear_line(tmp_path, capsys) -> None:
    model = tmp_path / "custom"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "my_lm", "auto_map": {"AutoConfig": "my_lm.MyConfig"}}))
    (model / "my_lm.py").write_text("raise SystemExit('remote code ran')\n")  # would end the test with that code
    code, stdout, stderr, _ = plan(capsys, "--model_name_or_path", str(model))
    assert code == 2 and stderr.startswith("error: ") and "--trust_remote_code" in stderr and stderr.count("\n") == 1
    assert "remote code ran" not in stderr + stdout


@pytest.mark.quick
def test_activations_count_the_logits_and_the_loss_backward() -> None:
    """A language model's peak is at the loss: fp32 log-probabilities (saved) and, in backward,
    their gradient and the logits' (tokens x vocabulary floats each)."""
    import torch

    from models.configs import build_named_config
    from models.language import build_tokenizer
    from parts.memory_plan.planner import activation_bytes, model_shape

    config = build_named_config("llama-tiny", build_tokenizer(None, None))
    batch, seq_len = 2, 64
    logits_fp32 = 4 * batch * seq_len * config.vocab_size
    for checkpointing in (False, True):
        estimate = activation_bytes(model_shape(config, torch.bfloat16), batch, seq_len, checkpointing)
        assert estimate > 3 * logits_fp32


@pytest.mark.quick
def test_model_state_bytes_are_counted_from_the_tensors(tiny_model) -> None:
    """One process, fp32 AdamW: 4 bytes of weights, 4 of gradients, 8 of moments per parameter."""
    optimizer = build_optimizer(tiny_model, TrainArguments(learning_rate=1e-3, weight_decay=0.1))
    ids = torch.randint(0, 900, (2, 16))
    tiny_model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    tiny_model(input_ids=ids, labels=ids).loss.backward()
    psi = sum(p.numel() for p in tiny_model.parameters())
    measured = model_state_bytes(tiny_model, optimizer)
    assert measured["parameters"] == 4 * psi and measured["gradients"] == 4 * psi
    assert 8 * psi <= measured["optimizer"] <= 8 * psi + 4 * len(optimizer.state)  # + one step counter each


@pytest.mark.quick
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "sgd"])
def test_model_state_is_measured_at_the_second_step_and_never_reported_as_zero(tiny_model, optim) -> None:
    optimizer = build_optimizer(tiny_model, TrainArguments(optim=optim))
    probe = model_state_probe(tiny_model, optimizer, list)
    ids = torch.randint(0, 900, (2, 16))
    for step in (1, 2):
        tiny_model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            assert probe == {}  # one step: nothing to report yet (the summary says "not measured")
    psi = sum(p.numel() for p in tiny_model.parameters())
    assert probe["parameters"] == 4 * psi and probe["gradients"] == 4 * psi
    assert probe["optimizer"] == pytest.approx(8 * psi if optim.startswith("adamw") else 0, rel=1e-3)  # + step counters


def test_a_ddp_run_reports_what_each_rank_holds(cached_run) -> None:
    summary = json.loads((cached_run("ddp", *SHORT_RUN) / "summary.json").read_text())  # test_performance.py's run
    psi = summary["parameters"]  # fp32 DDP: 4 + 4 + 8 bytes per parameter, every rank
    assert summary["model_state_bytes_per_rank"]["parameters"] == 4 * psi
    assert summary["model_state_bytes_per_rank"]["gradients"] == 4 * psi
    assert sum(summary["model_state_bytes_per_rank"].values()) == pytest.approx(16 * psi, rel=1e-3)  # ZeRO stage 0
