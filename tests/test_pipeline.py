"""Pipeline stages (--pipeline_parallel_size): every schedule, and 2 stages x 2 replicas, train what one process trains.

The model is a 4-layer Llama in Hub format (so Interleaved1F1B has a layer for each of its 4
stages). One process accumulates 4 micro-batches of 2; the pipelines cut batches into
micro-batches of 2 as well, so each forward sees the same shapes and only the order of the
gradient sums differs: the tolerance of tests/test_parity.py holds. Clipping triggers (0.5),
weight decay and the cosine schedule are on, evaluation and a checkpoint at step 4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from parts.pipeline.layout import check_pipeline_flags, check_pipeline_launch
from scripts.compare_metrics import compare, worst_difference
from tests.harness import (
    assert_continues_exactly,
    assert_same_final_weights,
    made_once,
    read_metrics,
    train,
    with_processes,
)
from tests.test_parity import LOSS_TOLERANCE, WEIGHT_TOLERANCE
from training.checkpoints.files import TrainerState
from training.checkpoints.resume import load_checkpoint
from training.arguments import FIELD_DEFAULTS, arguments_of, check_conflicts
from training.errors import ArgumentError, ResumeError, StrategyError
from training.flags import DataArguments, ModelArguments, TrainArguments
from training.strategy import Strategy

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

STEPS, SAVED = 8, 4
FLAGS = {"pipeline_stages": 2}  # a run's flags (named with their dashes in a refusal)
LAYOUTS = {  # name -> (processes, train.py flags): each a global batch of 8 in micro-batches of 2
    "single": (1, ("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4")),
    "GPipe": (2, ("--pipeline_parallel_size", "2", "--pipeline_schedule", "GPipe", "--pipeline_microbatches", "2",
                  "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")),
    "1F1B": (2, ("--pipeline_parallel_size", "2", "--pipeline_schedule", "1F1B", "--pipeline_microbatches", "4",
                 "--per_device_train_batch_size", "8")),
    "Interleaved1F1B": (2, ("--pipeline_parallel_size", "2", "--pipeline_schedule", "Interleaved1F1B",
                            "--pipeline_microbatches", "2", "--per_device_train_batch_size", "4",
                            "--gradient_accumulation_steps", "2")),
    "2 stages x 2 replicas": (4, ("--pipeline_parallel_size", "2", "--pipeline_microbatches", "2",
                                  "--per_device_train_batch_size", "4")),
}


@pytest.fixture(scope="session")
def four_layer_model(shared_dir) -> Path:
    """llama-tiny with 4 decoder layers, initialised and saved as a Hub-format directory."""
    from transformers import AutoModelForCausalLM

    from models.configs import build_named_config
    from models.language import build_tokenizer

    def make(directory: Path) -> None:
        tokenizer = build_tokenizer(None, None)
        config = build_named_config("llama-tiny", tokenizer)
        config.num_hidden_layers = 4
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return made_once(shared_dir / "four_layer_model", make)


def layout_args(model: Path, name: str) -> tuple[str, ...]:
    return ("--model_name_or_path", str(model), "--max_steps", str(STEPS), "--logging_steps", "1", "--eval_steps",
            str(SAVED), "--save_steps", str(SAVED), "--per_device_eval_batch_size", "2", "--max_grad_norm", "0.5",
            "--warmup_ratio", "0.1", *LAYOUTS[name][1])


@pytest.fixture(scope="session")
def pipeline_run(cached_run, four_layer_model, shared_dir):
    """`pipeline_run(name)`: the run of one of LAYOUTS, trained once per test run."""

    def run(name: str) -> Path:
        processes = LAYOUTS[name][0]
        config = "single" if processes == 1 else with_processes("ddp", processes, shared_dir / "configs")
        return cached_run(config, *layout_args(four_layer_model, name))

    return run


@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "single"])
def test_every_schedule_and_pp_x_dp_trains_what_one_process_trains(name, pipeline_run) -> None:
    reference, run = pipeline_run("single"), pipeline_run(name)
    differences = compare(reference, run, keys=("loss", "lr", "eval_loss"))
    assert len(differences) == STEPS * 2 + 3  # loss and lr at every step; eval at the start, step 4 and the end
    worst = worst_difference(differences)
    assert worst.absolute <= LOSS_TOLERANCE, worst
    assert max(m["grad_norm"] for m in read_metrics(run) if "grad_norm" in m) > 0.5  # clipping at work
    assert_same_final_weights(reference, run, atol=WEIGHT_TOLERANCE)  # final/ is the whole model, merged from the stages
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parameters"] == json.loads((reference / "summary.json").read_text())["parameters"]
    stages = 4 if name == "Interleaved1F1B" else 2
    saved = run / "checkpoints" / f"step_{SAVED}"
    assert sorted(p.name for p in saved.glob("pipeline_stage*")) == [f"pipeline_stage{i}.safetensors" for i in range(stages)]


def test_a_pipeline_resumes_exactly_and_refuses_another_layout(pipeline_run, four_layer_model, tmp_path) -> None:
    run = pipeline_run("Interleaved1F1B")  # two stages per process: the most files to put back
    shutil.copytree(run / "checkpoints" / f"step_{SAVED}", tmp_path / "checkpoints" / f"step_{SAVED}")
    train("ddp", tmp_path, *layout_args(four_layer_model, "Interleaved1F1B"), "--resume_from_checkpoint", "latest")
    assert_continues_exactly(run, tmp_path, SAVED, last_step=STEPS)
    with pytest.raises(ResumeError, match="laid out otherwise: parts/pipeline: --pipeline_stages was 4, is none; "
                                          "parts/pipeline: pipeline_stages_per_process was 2, is none; resume with the "
                                          "flags that laid it out so"):
        load_checkpoint(None, run / "checkpoints" / f"step_{SAVED}", TrainerState(global_batch=8, flags=FLAGS),
                        max_steps=STEPS)
    # the same 4 stages, one per process (1F1B on 4 processes): each process saved the optimizer of its own stages
    with pytest.raises(ResumeError, match="laid out otherwise: parts/pipeline: pipeline_stages_per_process was 2, is "
                                          "none; resume with"):
        load_checkpoint(None, run / "checkpoints" / f"step_{SAVED}",
                        TrainerState(global_batch=8, layout={"pipeline": {"pipeline_stages": 4}}, flags=FLAGS),
                        max_steps=STEPS)


@pytest.mark.quick
def test_a_checkpoint_of_an_earlier_version_keeps_its_pipeline_layout(tmp_path) -> None:
    """trainer_state.json before parts: `pipeline_stages` beside the step counts, read as the pipeline part's layout."""
    earlier = {"completed_steps": 4, "epoch": 0, "steps_in_epoch": 4, "global_batch": 8, "num_processes": 2,
               "pipeline_stages": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    (tmp_path / "trainer_state.json").write_text(json.dumps(earlier))
    two_stages = TrainerState(global_batch=8, layout={"pipeline": {"pipeline_stages": 2}}, flags=FLAGS)
    with pytest.raises(ResumeError, match="laid out otherwise: parts/pipeline: --pipeline_stages was 4, is 2; resume"):
        load_checkpoint(None, tmp_path, two_stages, max_steps=STEPS)
    # until 2026-12-08 the layout was one mapping, the pipeline's alone
    (tmp_path / "trainer_state.json").write_text(json.dumps(earlier | {"pipeline_stages": 1, "layout": {
        "pipeline_stages": 4, "pipeline_stages_per_process": 2}}))
    with pytest.raises(ResumeError, match="parts/pipeline: --pipeline_stages was 4, is 2; parts/pipeline: "
                                          "pipeline_stages_per_process was 2, is none; resume"):
        load_checkpoint(None, tmp_path, two_stages, max_steps=STEPS)


@pytest.mark.parts("images")
def test_a_resnet_pipeline_trains_what_one_process_trains(tmp_path) -> None:
    """BatchNorm in the stages: its running statistics (evaluation) and small-batch gradients (clipping) agree."""
    flags = ("--task", "image-classification", "--model_config", "resnet-tiny", "--max_steps", "6", "--logging_steps", "1",
             "--eval_steps", "3", "--save_strategy", "no", "--max_eval_samples", "24", "--learning_rate", "3e-3",
             "--warmup_steps", "2", "--per_device_eval_batch_size", "2")
    train("single", tmp_path / "one", *flags, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2")
    train("ddp", tmp_path / "stages", *flags, "--per_device_train_batch_size", "4", "--pipeline_parallel_size", "2",
          "--pipeline_microbatches", "2")
    differences = compare(tmp_path / "one", tmp_path / "stages", keys=("loss", "eval_loss", "eval_accuracy"))
    assert len(differences) == 6 + 3 * 2
    assert worst_difference(differences).absolute <= LOSS_TOLERANCE


def flags(**overrides) -> tuple[ModelArguments, DataArguments, TrainArguments]:
    """Two stages and `overrides` (given), every other flag at its default: the core's and the parts' (unchecked)."""
    return arguments_of(FIELD_DEFAULTS | {"pipeline_parallel_size": 2} | overrides,
                        frozenset({"pipeline_parallel_size", *overrides}))


REFUSED_FLAGS = {
    "batch not cut evenly": ({"per_device_train_batch_size": 6}, "--per_device_train_batch_size 6 is cut into"),
    "fewer micro-batches than stages for 1F1B": ({"pipeline_microbatches": 1, "per_device_train_batch_size": 1,
                                                  "per_device_eval_batch_size": 1}, "needs at least one micro-batch per stage"),
    "Interleaved1F1B rounds": ({"pipeline_schedule": "Interleaved1F1B", "pipeline_microbatches": 3,
                                "per_device_train_batch_size": 6, "per_device_eval_batch_size": 6}, "a multiple of it"),
    "layer split across GPUs as well": ({"device_map": "auto"}, "--device_map with --pipeline_parallel_size is not supported"),
    "LoRA": ({"use_peft": True}, "--use_peft with --pipeline_parallel_size is not supported"),
    "unpacked data": ({"packing": False}, "--packing false with --pipeline_parallel_size is not supported"),
}


@pytest.mark.quick
@pytest.mark.parametrize(("overrides", "message"), REFUSED_FLAGS.values(), ids=REFUSED_FLAGS.keys())
def test_flags_a_pipeline_cannot_run_are_refused(overrides, message) -> None:
    groups = flags(**overrides)
    with pytest.raises(ArgumentError, match=message):
        check_conflicts(*groups)  # what another part's flag cannot run with (`Pipeline.conflicts`)
        check_pipeline_flags(*groups)


@pytest.mark.quick
def test_launches_a_pipeline_cannot_run_are_refused() -> None:
    args = flags()[2]
    with pytest.raises(StrategyError, match="not fsdp: FSDP and ZeRO with pipeline stages are not supported"):
        check_pipeline_launch(args, Strategy.FSDP, 2)
    with pytest.raises(StrategyError, match="3 processes cannot hold whole pipelines"):
        check_pipeline_launch(args, Strategy.DDP, 3)
    check_pipeline_launch(args, Strategy.DDP, 4)


@pytest.mark.quick
def test_models_stages_cannot_hold_are_refused_with_what_is_supported() -> None:
    from transformers import AutoModelForCausalLM

    from models.configs import build_named_config
    from models.language import build_tokenizer
    from parts.pipeline.stages import StageError, split_into_stages

    config = build_named_config("llama-tiny", build_tokenizer(None, None))
    with pytest.raises(StageError, match="2 layers cannot fill 4 pipeline stages"):
        split_into_stages(AutoModelForCausalLM.from_config(config), 4)
    config.tie_word_embeddings = True
    with pytest.raises(StageError, match="pipeline stages need untied embeddings"):
        split_into_stages(AutoModelForCausalLM.from_config(config), 2)
    with pytest.raises(StageError, match="pipeline stages are defined for decoder-only Llama-family"):
        split_into_stages(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)
    # bad input: one error line and exit 2, as the core's errors (tests/test_clean_exit.py)
    assert (StageError.exit_code, StageError.prefix, StageError.every_rank) == (2, "error", False)


@pytest.mark.quick
def test_stages_compute_what_the_whole_model_computes() -> None:
    """Run one after another in one process, the stages give the model's logits; uneven layer counts balance."""
    from transformers import AutoModelForCausalLM

    from models.configs import build_named_config
    from models.language import build_tokenizer
    from parts.pipeline.stages import balanced, split_into_stages

    assert balanced(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    config = build_named_config("llama-tiny", build_tokenizer(None, None))
    config.num_hidden_layers = 3
    model = AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    hidden = tokens
    for stage in split_into_stages(model, 2):
        hidden = stage(hidden)
    torch.testing.assert_close(hidden, model(input_ids=tokens).logits, rtol=0, atol=0)


def test_the_dry_run_plans_stages_per_process(monkeypatch, tmp_path) -> None:
    """The plan counts replicas, not processes, in the global batch, and one process's stages in its memory."""
    from training.arguments import parse_args
    from training.dry_run import dry_run

    monkeypatch.setenv("WORLD_SIZE", "4")  # as `accelerate launch --config_file ddp.yaml --num_processes 4` sets it
    plans = {size: dry_run(*parse_args(["--model_config", "llama-tiny", "--pipeline_parallel_size", str(size),
                                        "--pipeline_microbatches", "2", "--dry_run", "--output_dir", str(tmp_path)]))
             for size in (1, 2)}
    assert "2 pipeline stages (1F1B, 2 micro-batches)" in plans[2] and "pipeline" not in plans[1]
    assert "global batch:    16 = 8 per device x 2 data-parallel" in plans[2]
    held = {size: float(plan.split("parameters ")[2].split(",")[0]) for size, plan in plans.items()}
    assert 0.4 * held[1] <= held[2] <= 0.6 * held[1]  # two balanced stages (MiB to one decimal: 0.4 of 0.9)
    assert "trained, at most" in plans[2] and "at most" not in plans[1]  # the model line: one process's share
