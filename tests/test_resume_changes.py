"""A resume does what the user typed: each flag given otherwise than the checkpoint's run gave it is honoured from the
resumed step and logged once, or refused in one line (training/checkpoints/changes.py, docs/train-py.md "What a resume
may change"); recipe values get the command line's parsing; the model is compared by what it computes."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from tests.harness import SPLITS, TINY_RUN, bad_input_errors, launch, read_metrics, split_run_args, train
from training.arguments import ArgumentError, parse_args
from training.checkpoints.changes import check_changes, recorded_flags
from training.checkpoints.files import TrainerState
from training.checkpoints.resume import load_checkpoint
from training.errors import ResumeError
from training.flags import every_flag
from training.parts import installed

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


def state_of(tmp_path: Path, *argv: str, groups: int = 2) -> TrainerState:
    """What a run launched with `argv` records (its flags, as parsed and checked) at step 4."""
    flags = every_flag(*parse_args(["--output_dir", str(tmp_path / "out"), *argv]))
    return TrainerState(completed_steps=4, flags=recorded_flags(flags), optimizer_groups=groups)


# flag given on resume -> its line ("honoured": logged as "<flag> <old> -> <new> from step 4"), or the refusal
CHANGES = {
    ("--learning_rate", "5e-4"): "learning_rate 0.001 -> 0.0005 from step 4 (changed on resume)",
    ("--warmup_steps", "3"): "warmup_steps None -> 3 from step 4",
    ("--lr_scheduler_type", "linear"): "lr_scheduler_type cosine -> linear from step 4",
    ("--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}'):
        'lr_scheduler_kwargs {} -> {"min_lr_rate": 0.1} from step 4',
    ("--weight_decay", "0.0"): "weight_decay 0.1 -> 0.0 from step 4",
    ("--adam_beta2", "0.999"): "adam_beta2 0.95 -> 0.999 from step 4",
    ("--adam_epsilon", "1e-6"): "adam_epsilon 1e-08 -> 1e-06 from step 4",
    ("--max_grad_norm", "0.5"): "max_grad_norm 1.0 -> 0.5 from step 4",
    ("--block_size", "32"): "block_size None -> 32 from step 4",
    ("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"):
        "gradient_accumulation_steps 1 -> 2 from step 4",
    ("--seed", "7"): ResumeError("was trained with --seed 42 and this run gives --seed 7, which a resume cannot change "
                                 "(the data order of the epoch it resumes in"),
    ("--lr_scheduler_type", "reduce_lr_on_plateau"): ResumeError(
        "was trained with --lr_scheduler_type cosine and this run gives --lr_scheduler_type reduce_lr_on_plateau, which a "
        "resume cannot change (reduce_lr_on_plateau keeps the rate and its settings in state of its own"),
    ("--output_dir", "elsewhere", "--report_to", "tensorboard", "--run_name", "again"): None,  # where it runs: silent
}
if installed("ema"):
    CHANGES[("--ema_decay", "0.99")] = "ema_decay 0.0 -> 0.99 from step 4"
if installed("compression"):
    CHANGES[("--ddp_comm_hook", "power_sgd")] = ResumeError(
        "was trained with --ddp_comm_hook None and this run gives --ddp_comm_hook power_sgd, which a resume cannot "
        "change (parts/compression: PowerSGD's saved state is the hook's own")
if installed("streaming"):
    CHANGES[("--streaming", "--max_steps", "10", "--max_eval_samples", "8")] = ResumeError(
        "was trained with --streaming False and this run gives --streaming True, which a resume cannot change "
        "(parts/streaming: a stream resumes from its saved position")


@pytest.mark.quick
@pytest.mark.parametrize("given", CHANGES, ids=" ".join)
def test_a_flag_changed_on_resume_is_honoured_and_logged_once_or_refused(given, tmp_path) -> None:
    """A run at 1e-3 resumed with --learning_rate 5e-4 trained on at 1e-3 with no line (issue 69): every flag is now
    compared with the checkpoint's, and each change is a line (logged once the resume has loaded), or a refusal
    naming the flag."""
    saved = state_of(tmp_path, "--learning_rate", "1e-3")
    given = tuple(str(tmp_path / word) if word == "elsewhere" else word for word in given)
    this_run = state_of(tmp_path, "--learning_rate", "1e-3", *given)
    expected = CHANGES[tuple("elsewhere" if word.endswith("elsewhere") else word for word in given)]
    if isinstance(expected, ResumeError):
        with pytest.raises(ResumeError, match="^" + re.escape(f"step_4 {expected}")):
            check_changes(Path("step_4"), saved, this_run)
        return
    lines = check_changes(Path("step_4"), saved, this_run)
    if expected is None:
        assert lines == []
        return
    assert expected in "\n".join(lines) and len(lines) == len(set(lines)) == len([f for f in given if f[:2] == "--"])


@pytest.mark.quick
def test_a_stateful_schedule_keeps_its_settings(tmp_path) -> None:
    """reduce_lr_on_plateau restores its factor and patience from the checkpoint's state: a change would be dropped."""
    plateau = ("--lr_scheduler_type", "reduce_lr_on_plateau")
    for changed in (("--lr_scheduler_kwargs", '{"patience": 3}'), ("--learning_rate", "5e-4")):
        with pytest.raises(ResumeError, match=f"this run gives {changed[0]} .*reduce_lr_on_plateau keeps the rate"):
            check_changes(Path("step_4"), state_of(tmp_path, *plateau), state_of(tmp_path, *plateau, *changed))
    assert check_changes(Path("step_4"), state_of(tmp_path, *plateau), state_of(tmp_path, *plateau, "--seed", "42",
                                                                                  "--eval_steps", "5")) == [
        "eval_steps 100 -> 5 from step 4 (changed on resume)"]


@pytest.mark.quick
def test_another_number_of_optimizer_groups_is_refused_in_one_line(tmp_path) -> None:
    """A part's groups changed on resume ended in zip()'s ValueError at the first step (issue 69)."""
    with pytest.raises(ResumeError, match=r"^step_4 holds an optimizer of 2 parameter groups and this run's has 4 \(the "
                                          "groups a part's flags or the model's trainable parameters make\); resume "
                                          "with the flags it was trained with"):
        check_changes(Path("step_4"), state_of(tmp_path), state_of(tmp_path, groups=4))
    check_changes(Path("step_4"), state_of(tmp_path, groups=0), state_of(tmp_path))  # (not recorded before 2026-12-07)


@pytest.mark.quick
def test_a_parts_layout_of_any_json_value_is_refused_naming_the_part_and_setting(tmp_path) -> None:
    """`checkpoint_layout` (by part): a setting a flag sets named with its dashes, another by its key, a part the
    checkpoint did not record as `none`."""
    (tmp_path / "trainer_state.json").write_text(json.dumps({"completed_steps": 4, "global_batch": 8, "layout": {
        "mine": {"my_flag": 0.8, "stages": [0, 2]}}}))
    this_run = TrainerState(global_batch=8, flags={"my_flag": 0.5}, layout={"mine": {"my_flag": 0.5, "stages": [0, 2]},
                                                                           "other": {"cut": "rows"}})
    with pytest.raises(ResumeError, match=re.escape(
            f"{tmp_path} holds a model laid out otherwise: parts/mine: --my_flag was 0.8, is 0.5; parts/other: cut was "
            "none, is 'rows'; resume with the flags that laid it out so")):
        load_checkpoint(None, tmp_path, this_run, max_steps=10)


# recipe values left empty or of the wrong kind: each refused as the command line refuses it, naming the file
RECIPES = {
    "max_steps:\n": "recipe {path}: max_steps is empty; give it a value",
    "per_device_train_batch_size:\n": "recipe {path}: per_device_train_batch_size is empty",
    "learning_rate:\n": "recipe {path}: learning_rate is empty",
    "max_steps: 2.5\n": "recipe {path}: argument --max_steps/--max-steps: invalid int value: '2.5'",
    "gradient_accumulation_steps: two\n": "recipe {path}: argument --gradient_accumulation_steps/"
                                          "--gradient-accumulation-steps: invalid int value: 'two'",
    "eval_strategy: sometimes\n": "recipe {path}: argument --eval_strategy/--eval-strategy: invalid choice: "
                                  "'sometimes'",
    "learning_rate: [0.1, 0.2]\n": "recipe {path}: learning_rate takes one value, got [0.1, 0.2]",
}


@pytest.mark.quick
@pytest.mark.parametrize("text", RECIPES)
def test_a_recipe_value_gets_the_command_lines_parsing(text, tmp_path) -> None:
    """`max_steps:` left empty, or 2.5 for an integer, was a TypeError traceback deep in set-up (issue 69)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    with pytest.raises(ArgumentError, match="^" + re.escape(RECIPES[text].format(path=recipe))):
        parse_args(["--output_dir", str(tmp_path / "out"), "--config", str(recipe)])


@pytest.mark.quick
def test_recipe_values_as_users_write_them_parse_as_on_the_command_line(tmp_path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_steps: 3\nlearning_rate: 1.0e-4\nwarmup_steps:\nreport_to: []\neval_on_start: false\n"
                      "lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: {min_lr_rate: 0.1}\n"
                      "sample_prompt: '--not a flag'\n")
    model_args, data_args, args = parse_args(["--output_dir", str(tmp_path / "out"), "--config", str(recipe),
                                              "--max_steps", "5"])
    assert (args.max_steps, args.learning_rate, args.warmup_steps, args.report_to, args.eval_on_start) == \
        (5, 1e-4, None, [], False)
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and data_args.sample_prompt == "--not a flag"
    assert {"max_steps", "learning_rate", "warmup_steps", "lr_scheduler_kwargs"} <= args.given


@pytest.mark.quick
def test_the_model_is_compared_by_what_it_computes_not_how_it_was_named(tmp_path) -> None:
    """A run begun from --model_name_or_path final/ and resumed with the same model through --model_config was
    refused over `architectures` (issue 69); the docs' RoPE example names real fields, and is refused unless named."""
    from types import SimpleNamespace

    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    from models.configs import build_named_config
    from models.language import build_tokenizer
    from training.checkpoints.resume import check_same_model, model_description

    PartialState()  # (a change named on purpose is logged)

    task, tokenizer = SimpleNamespace(model_kwargs=None), build_tokenizer(None, None)
    built = AutoModelForCausalLM.from_config(build_named_config("llama-tiny", tokenizer))
    built.save_pretrained(tmp_path / "final")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    check_same_model(Path("step_4"), model_description(task, loaded), model_description(task, built), None)
    docs = (Path(__file__).parents[1] / "docs" / "train-py.md").read_text()
    overrides = "rope_parameters.rope_theta=500000,max_position_embeddings=4096"
    assert f"--config_overrides {overrides}\n--allow_config_changes rope_parameters,max_position_embeddings" in docs
    extended = build_named_config("llama-tiny", tokenizer, overrides)
    assert extended.rope_parameters["rope_theta"] == 500000.0 and extended.max_position_embeddings == 4096
    longer = model_description(task, AutoModelForCausalLM.from_config(extended))
    with pytest.raises(ResumeError, match=r"max_position_embeddings \(\d+ -> 4096\), rope_parameters"):
        check_same_model(Path("step_4"), model_description(task, built), longer, None)
    check_same_model(Path("step_4"), model_description(task, built), longer, "rope_parameters,max_position_embeddings")
    with pytest.raises(ValueError, match="key rope_theta isn't in the original config dict; RoPE's settings are fields "
                                         "of rope_parameters, e.g. rope_parameters.rope_theta=500000"):
        build_named_config("llama-tiny", tokenizer, "rope_theta=500000")
    alone = build_named_config("llama-tiny", tokenizer, "rope_parameters.rope_theta=500000")  # (a dotted key alone)
    yarn = build_named_config("llama-tiny", tokenizer, "rope_parameters.rope_type=yarn,rope_parameters.factor=4.0")
    assert alone.rope_parameters["rope_theta"] == 500000.0 and alone.max_position_embeddings == built.config.max_position_embeddings
    assert yarn.rope_parameters == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}
    for bad, message in (("rope_parameters.rope_theta=high", "rope_theta is a float"),
                         ("rope_parameters.rope_theta", "has no value; give it as key=value"),
                         ("vocab_size.x=1", "vocab_size is not a dict field")):
        with pytest.raises(ValueError, match=message):
            build_named_config("llama-tiny", tokenizer, bad)


RESUMED_AT = 8  # the split runs' mid-epoch checkpoint (tests/harness.py split_args: saved every 4 steps of 10)


@pytest.mark.skipif(not installed("ema"), reason="copies an average into the checkpoint")
def test_a_resume_under_fsdp_honours_a_lower_rate_and_reads_only_what_the_manifest_lists(
        split_run, strategy_run, uneven_data, tmp_path) -> None:
    """One launch, what a user does after a loss spike: resume with half the rate (and another block size). Every
    later step runs at half the uninterrupted run's rate, and each change is one line. Another run's average (ema/),
    copied into the checkpoint, is not the manifest's: named, hidden, and the average starts from the weights."""
    run = split_run("fsdp-2x2x2")
    checkpoint = tmp_path / "checkpoints" / f"step_{RESUMED_AT}"
    shutil.copytree(run / "checkpoints" / f"step_{RESUMED_AT}", checkpoint)
    shutil.copytree(strategy_run("fsdp") / "checkpoints" / "step_12" / "ema", checkpoint / "ema")
    args = [*split_run_args(uneven_data, "fsdp-2x2x2")]
    args[args.index("--block_size") + 1] = "48"
    result = train("fsdp", tmp_path, *args, "--learning_rate", "1.5e-3", "--ema_decay", "0.9",
                   "--resume_from_checkpoint", "latest")
    for line in ("learning_rate 0.003 -> 0.0015 from step 8 (changed on resume)",
                 "block_size 64 -> 48 from step 8 (changed on resume)", "ema_decay 0.0 -> 0.9 from step 8",
                 f"{checkpoint.name} holds files its manifest.json does not list, which are not read: "
                 "ema/rank0.safetensors, ema/rank1.safetensors",
                 "holds no average of the weights (saved without --ema_decay): the average starts from the resumed "
                 "weights"):
        assert result.stderr.count(line) == 1, (line, result.stderr[-3000:])
    rates = {m["step"]: m["lr"] for m in read_metrics(run) if "lr" in m}
    resumed = {m["step"]: m["lr"] for m in read_metrics(tmp_path) if "lr" in m}
    assert sorted(resumed) == [9, 10]
    for step, rate in resumed.items():
        assert rate == pytest.approx(rates[step] / 2, rel=1e-12), step


def test_an_evaluation_takes_any_optimizer_and_block_size_and_refuses_an_average_it_lacks(
        split_run, uneven_data, tmp_path) -> None:
    """--do_train false refused --optim sgd or another --block_size than the checkpoint's (issue 69): an evaluation
    compares the model alone. And --ema_decay on a checkpoint without an average reported eval_ema_* equal to the
    weights' own: refused in one line, after every other check has passed."""
    run = split_run("2x4x1")
    args = [*split_run_args(uneven_data, "2x4x1")]
    args[args.index("--block_size") + 1] = "32"
    flags = ["--do_train", "false", "--optim", "sgd", "--resume_from_checkpoint",
             str(run / "checkpoints" / f"step_{RESUMED_AT}")]
    if not installed("ema"):
        scored = train("ddp", tmp_path, *args, *flags)
        assert json.loads((tmp_path / "summary.json").read_text())["total_steps"] == RESUMED_AT
        assert "changed on resume" not in scored.stderr
        return
    # (the average is read after the model's state, under this run's optimizer: every check before it passed)
    refused = launch(SPLITS["2x4x1"][0], "train.py", *TINY_RUN, "--output_dir", str(tmp_path), *args, *flags,
                     "--ema_decay", "0.9")
    errors = bad_input_errors(refused)
    assert len(errors) == 1 and errors[0].endswith(
        "holds no average of the weights (saved without --ema_decay), so --do_train false --ema_decay has none to "
        "evaluate; drop --ema_decay"), errors
    assert "changed on resume" not in refused.stderr


@pytest.mark.quick
@pytest.mark.parts("distillation")  # training/checkpoints/frozen.py: DPO's and distillation's (kept with either)
def test_a_frozen_model_is_known_by_its_weights_and_configuration_not_its_path(tiny_model, tmp_path, caplog) -> None:
    """DPO's reference and a teacher (training/checkpoints/frozen.py): the same model moved elsewhere is logged; other
    weights or another configuration are refused unless named in --allow_config_changes; a checkpoint that records
    none (before 2026-12-07) is taken as it is; a Hub model is known by its revision."""
    from accelerate import PartialState

    from tests.harness import nudged_copy
    from training.checkpoints.frozen import check_frozen_identity, frozen_identity, save_frozen_identity

    PartialState()
    tiny_model.save_pretrained(tmp_path / "model")
    moved, nudged = tmp_path / "moved", nudged_copy(tmp_path / "model", tmp_path / "nudged")
    shutil.copytree(tmp_path / "model", moved)
    checkpoint = tmp_path / "step_4"
    checkpoint.mkdir()
    check_frozen_identity(checkpoint, "teacher_model", frozen_identity(str(moved), tiny_model), "teacher", None)
    save_frozen_identity(checkpoint, "teacher_model", frozen_identity(str(tmp_path / "model"), tiny_model))
    with caplog.at_level(logging.WARNING):
        check_frozen_identity(checkpoint, "teacher_model", frozen_identity(str(moved), tiny_model), "teacher", None)
    assert f"teacher model: {tmp_path / 'model'} -> {moved}, the same weights and configuration" in caplog.text
    other = frozen_identity(str(nudged), tiny_model)
    with pytest.raises(ResumeError, match=r"trained against another teacher model .* \(its weights differ\); resume "
                                          "with --teacher .*, or name the change on purpose: --allow_config_changes "
                                          "teacher_model$"):
        check_frozen_identity(checkpoint, "teacher_model", other, "teacher", "rope_parameters")
    check_frozen_identity(checkpoint, "teacher_model", other, "teacher", "rope_parameters,teacher_model")
    tiny_model.config.rms_norm_eps = 0.5
    with pytest.raises(ResumeError, match=r"\(its configuration differs\)"):
        check_frozen_identity(checkpoint, "teacher_model", frozen_identity(str(moved), tiny_model), "teacher", None)
    hub = frozen_identity("org/model", tiny_model)
    assert hub["weights"] == "revision None" and frozen_identity("org/model")["weights"] is None
    # a Hub reference whose scores a checkpoint kept (nothing loaded to compare): known by its id; the record carried
    save_frozen_identity(checkpoint, "reference_model", hub)
    with pytest.raises(ResumeError, match=r"reference model org/model -> org/other \(its source differs\)"):
        check_frozen_identity(checkpoint, "reference_model", frozen_identity("org/other"), "model_name_or_path", None)
    kept = check_frozen_identity(checkpoint, "reference_model", frozen_identity("org/model"), "model_name_or_path", None)
    assert kept == hub  # (saved again: a later resume that loads the model compares all of it)
