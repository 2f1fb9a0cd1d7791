"""Knowledge distillation (parts/distillation): the divergences, the teacher checks, and real runs
of a student distilled from a frozen teacher under every config file, agreeing with one process."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from models.language import ModelError
from parts.distillation.teacher import check_teacher, divergence, memory_warning, teacher_bytes_per_rank
from scripts.compare_metrics import compare, worst_difference
from tests.harness import (
    CONFIGS,
    TINY_RUN,
    assert_continues_exactly,
    assert_same_final_weights,
    bad_input_errors,
    flag_refusal,
    launch,
    nudged_copy,
    read_metrics,
    train,
)
from training.arguments import parse_args
from training.parts import installed
from training.strategy import Strategy
from training.task_registry import build_task

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

DISTILLED_CONFIGS = sorted(path.stem for path in CONFIGS.glob("*.yaml") if path.stem not in {"single", "fsdp_tp"})
STEPS, RESUME_STEP = 6, 3
LOSS_TOLERANCE = WEIGHT_TOLERANCE = 1e-5  # test_parity.py's
CLIPPING = 0.5  # above these runs' gradient norms


@pytest.mark.quick
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_each_divergence_is_its_textbook_formula_at_the_temperature(kind) -> None:
    generator = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(3, 5, 11, generator=generator) for _ in range(2))
    temperature = 2.0
    p, q = F.softmax(teacher / temperature, -1), F.softmax(student / temperature, -1)  # teacher, student

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * (a.log() - b.log())).sum(-1)

    expected = {"forward_kl": kl(p, q), "reverse_kl": kl(q, p), "jsd": (kl(p, (p + q) / 2) + kl(q, (p + q) / 2)) / 2}[kind]
    measured = divergence(kind, temperature)(student, teacher)
    torch.testing.assert_close(measured, expected * temperature**2, rtol=1e-5, atol=1e-6)
    assert torch.all(divergence(kind, temperature)(student, student).abs() < 1e-5)  # none between equal models
    if kind == "jsd":  # symmetric and bounded by log 2
        torch.testing.assert_close(measured, divergence(kind, temperature)(teacher, student))
        assert torch.all(measured <= math.log(2) * temperature**2)


@pytest.mark.quick
def test_the_teacher_memory_is_planned_per_strategy_and_an_oversized_one_is_warned_with_the_estimate() -> None:
    parameters = 2**30  # 1 G parameters on 8 processes
    assert teacher_bytes_per_rank(Strategy.DDP, parameters, 8, compute_bytes=2) == 4 * 2**30  # an fp32 replica
    assert teacher_bytes_per_rank(Strategy.FSDP, parameters, 8, compute_bytes=2) == 4 * 2**30 / 8  # fp32 shards
    assert teacher_bytes_per_rank(Strategy.DEEPSPEED, parameters, 8, compute_bytes=2) == 2 * 2**30 / 8  # bf16 ZeRO-3
    assert teacher_bytes_per_rank(Strategy.DEEPSPEED, parameters, 8, compute_bytes=2, stage=2) == 2 * 2**30  # whole
    warning = memory_warning("big-teacher", 4 * 2**30, 3 * 2**30, torch.device("cuda"))
    assert "teacher big-teacher needs about 4.00 GiB" in warning and "3.00 GiB free on cuda" in warning
    assert "shard it" in warning and memory_warning("big-teacher", 2**30, 3 * 2**30, torch.device("cuda")) is None


REFUSED = [  # (flags, launcher environment, what the one line says); a case that needs another part is marked so
    pytest.param(["--distillation_temperature", "3"], {},
                 "--distillation_temperature is for distillation: add --teacher_model_name_or_path", id="a setting without a teacher"),
    pytest.param(["--teacher_model_name_or_path", "t", "--distillation_temperature", "0"], {},
                 "--distillation_temperature must be > 0, got 0.0", id="temperature 0"),
    pytest.param(["--teacher_model_name_or_path", "t", "--device_map", "auto"], {},
                 "--teacher_model_name_or_path with --device_map is not supported", id="--device_map",
                 marks=pytest.mark.parts("layer_split")),
    pytest.param(["--teacher_model_name_or_path", "t"], {"PARALLELISM_CONFIG_TP_SIZE": "2"},
                 "--teacher_model_name_or_path with tensor parallelism (fsdp_tp.yaml) is not supported", id="fsdp_tp.yaml",
                 marks=pytest.mark.parts("tensor_parallel")),
    pytest.param(["--teacher_model_name_or_path", "t", "--task", "recipes.csv_classification:CsvClassification"], {},
                 "the task names no transformers class to load a teacher with", id="a task with no auto_model",
                 marks=pytest.mark.parts("recipes")),
    pytest.param(["--teacher_model_name_or_path", "t", "--pipeline_parallel_size", "2"], {},
                 "--teacher_model_name_or_path with --pipeline_parallel_size is not supported", id="pipeline stages",
                 marks=pytest.mark.parts("pipeline")),
]


@pytest.mark.quick
@pytest.mark.parametrize(("args", "env", "message"), REFUSED)
def test_distillation_flags_that_cannot_run_are_one_line(args, env, message, monkeypatch, tmp_path) -> None:
    assert message in flag_refusal([*TINY_RUN, "--output_dir", str(tmp_path), *args], env, monkeypatch)


@pytest.mark.quick
@pytest.mark.parts("images")
def test_an_image_teacher_for_other_labels_is_one_line(tmp_path) -> None:
    AutoConfig.for_model("resnet", id2label={0: "cat", 1: "dog"}, label2id={"cat": 0, "dog": 1}).save_pretrained(tmp_path)
    model_args, data_args, _ = parse_args(["--task", "image-classification", "--output_dir", str(tmp_path / "run")])
    task = build_task(model_args, data_args)
    task.labels = ["circle", "square"]  # the student's, from its data
    with pytest.raises(ModelError, match=re.escape("classifies into ['cat', 'dog'], the data into ['circle', 'square']")):
        check_teacher(task, str(tmp_path))


def student_args(config: str) -> tuple[str, ...]:
    """llama-tiny from scratch on the story corpus: a global batch of 8 (one process accumulates 2 micro-batches
    of 4), 6 steps, clipping at 0.5 (which never triggers), a checkpoint at step 3."""
    return ("--max_steps", str(STEPS), "--logging_steps", "1", "--eval_steps", str(STEPS), "--save_steps",
            str(RESUME_STEP), "--max_grad_norm", str(CLIPPING), "--gradient_accumulation_steps", "2" if config == "single" else "1")


def teacher_args(teacher: Path) -> tuple[str, ...]:
    """Taught by `teacher` (another model the suite trained, same tokenizer), no distillation default left."""
    return ("--teacher_model_name_or_path", str(teacher), "--distillation_alpha", "0.7",
            "--distillation_temperature", "1.5", "--distillation_loss", "jsd")


@pytest.fixture(scope="session")
def distilled_run(cached_run, tied_base_model):
    """`distilled_run(config)`: the student of one config, taught by the tied-embedding base model."""
    return lambda config: cached_run(config, *student_args(config), *teacher_args(tied_base_model))


SECOND_MODEL = re.compile(r"(model|pytorch_model|pytorch_model_fsdp)_1\b")  # what accelerate names a second prepared model


@pytest.mark.parametrize("config", DISTILLED_CONFIGS)
def test_every_config_file_distils_what_one_process_distils(config, distilled_run, cached_run, tied_base_model) -> None:
    """Per-step losses, lr and the student's eval loss equal one process's. The teacher is frozen beside the
    student: its weights are reported apart, and it is in no optimizer, checkpoint or export."""
    reference, run = distilled_run("single"), distilled_run(config)
    differences = compare(reference, run, keys=("loss", "lr", "eval_loss"))
    assert len(differences) == STEPS * 2 + 2  # loss and lr at every step, eval at the start and the end
    worst = worst_difference(differences)
    assert worst.absolute <= LOSS_TOLERANCE, worst
    grad_norms = [m["grad_norm"] for m in read_metrics(run) if "grad_norm" in m]
    assert max(grad_norms) < CLIPPING  # never clipped: test_parity.py's case where clipping never triggers
    assert_same_final_weights(reference, run, atol=WEIGHT_TOLERANCE)
    alone = cached_run("single", *student_args("single"))  # the same student without a teacher
    distilled, plain = ([m["loss"] for m in read_metrics(r) if "loss" in m] for r in (reference, alone))
    assert all(abs(a - b) > 1e-3 for a, b in zip(distilled, plain))
    assert [m["eval_loss"] for m in read_metrics(reference) if "eval_loss" in m][0] == pytest.approx(
        [m["eval_loss"] for m in read_metrics(alone) if "eval_loss" in m][0])  # eval_loss: the student's own

    summary = json.loads((run / "summary.json").read_text())
    if installed("memory_plan"):  # the part's planner, against what the run held: the student's alone
        from tests.fixtures.memory_plan import assert_planned_model_state

        assert_planned_model_state(summary, config, "no")
    teacher_parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tied_base_model).parameters())
    held = summary["teacher_state_bytes_per_rank"]["parameters"]
    if config == "fsdp" or "zero3" in config:  # sharded: FSDP2's rows, ZeRO-3's partitions (small ones kept whole)
        assert 0 < held <= 4 * teacher_parameters * (0.55 if config == "fsdp" else 1.0)
    else:  # a whole fp32 copy (CPU): ddp, and ZeRO-1/2's stage-0 engine, as TRL places a reference
        assert held == 4 * teacher_parameters
    log = (run / "launch.log").read_text()
    assert f"{teacher_parameters:,} parameters, frozen" in log and "teacher state " in log  # full size, even partitioned
    assert not [p for p in (run / "checkpoints").rglob("*") if SECOND_MODEL.match(p.name)]


def test_a_distilled_run_resumes_exactly_under_zero3(distilled_run, tied_base_model, tmp_path) -> None:
    """The ZeRO-3 student beside its ZeRO-3 inference-engine teacher."""
    full = distilled_run("deepspeed_zero3")
    checkpoint = full / "checkpoints" / f"step_{RESUME_STEP}"
    shutil.copytree(checkpoint, tmp_path / "checkpoints" / f"step_{RESUME_STEP}")
    result = train("deepspeed_zero3", tmp_path, *student_args("deepspeed_zero3"), *teacher_args(tied_base_model),
                   "--resume_from_checkpoint", "latest")
    assert f"at step {RESUME_STEP}" in result.stderr
    assert_continues_exactly(full, tmp_path, RESUME_STEP, last_step=STEPS)


def test_a_resume_from_another_teacher_is_refused_in_one_line(distilled_run, tied_base_model, tmp_path) -> None:
    """A checkpoint records its teacher (teacher_model.json: source, configuration, weights' SHA-256): another
    teacher of the same config would silently change the loss (issue 69)."""
    checkpoint = distilled_run("deepspeed_zero3") / "checkpoints" / f"step_{RESUME_STEP}"
    other = nudged_copy(tied_base_model, tmp_path / "other")
    result = launch("deepspeed_zero3", "train.py", *TINY_RUN, "--output_dir", str(tmp_path / "out"),
                    *student_args("deepspeed_zero3"), *teacher_args(other), "--resume_from_checkpoint", str(checkpoint))
    errors = bad_input_errors(result)
    assert errors == [f"error: {checkpoint} was trained against another teacher model {tied_base_model} -> {other} "
                      f"(its weights differ); resume with --teacher_model_name_or_path {tied_base_model}, or name the "
                      "change on purpose: --allow_config_changes teacher_model"], errors
