"""Flags, recipes and their precedence."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from transformers.optimization import Adafactor

from tests.harness import REPO
from training.arguments import ArgumentError, parse_args
from training.optim import build_optimizer, build_scheduler
from training.task_registry import flag_owners


@pytest.mark.quick
def test_defaults_then_recipe_then_command_line(tmp_path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.01\nmax_steps: 7\nmodel_config: llama-tiny\n")
    model_args, _, train_args = parse_args(["--config", str(recipe), "--max_steps", "9", "--output_dir", str(tmp_path)])
    assert (train_args.learning_rate, train_args.max_steps, model_args.model_config) == (0.01, 9, "llama-tiny")
    assert train_args.per_device_train_batch_size == 8  # untouched default


@pytest.mark.quick
@pytest.mark.parametrize(
    ("recipe_text", "argv", "message"),
    [
        ("learnin_rate: 0.01\n", [], "unknown key 'learnin_rate' in recipe .*did you mean 'learning_rate'"),
        ("max_steps: [1\n", [], "is not valid YAML"),
        (None, ["--max_stepz", "3"], "unknown key 'max_stepz' in the command line; did you mean 'max_steps'"),
        (None, ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be at least 1"),
        (None, ["--max_steps", "0"], "nothing to train"),
        (None, ["--do_train", "false", "--eval_strategy", "no"], "--do_train false evaluates only, and --eval_strategy no"),
        (None, ["--validation_file", "v.txt"], "--validation_file needs --train_file"),
        ("model_config: gpt-9\n", [], "argument --model_config/--model-config: invalid choice: 'gpt-9'"),
        (None, ["--learning_rat", "1e-3"], "unknown key 'learning_rat' in the command line; did you mean 'learning_rate'"),
        (None, ["--bf16"], "'bf16' in the command line is a launcher setting here: accelerate launch --mixed_precision bf16"),
        (None, ["--fp16"], "launcher setting here: accelerate launch --mixed_precision fp16"),
        (None, ["--mixed_precision", "bf16"], "'mixed_precision' in the command line is a launcher setting here: give it "
                                              "to the launcher, before train.py"),
        ("bf16: true\n", [], "'bf16' in recipe .* is a launcher setting here"),
        (None, ["--max_steps", "-3"], "--max_steps must be -1 .* or a positive number of steps, got -3"),
        (None, ["--warmup_ratio", "1.0"], r"--warmup_ratio must be in \[0, 1\), got 1.0"),
        (None, ["--warmup_steps", "-1"], "--warmup_steps must be >= 0"),
        (None, ["--adam_beta2", "1.5"], "--optim adamw_torch_fused .* cannot start: Invalid beta parameter at index 1"),
        (None, ["--adam_epsilon", "-1"], "cannot start: Invalid epsilon value"),
        (None, ["--lr_scheduler_kwargs", "{min_lr: 1}"], "--lr_scheduler_kwargs is not valid JSON"),
        (None, ["--lr_scheduler_kwargs", "[1, 2]"], "--lr_scheduler_kwargs must be a JSON object"),
        (None, ["--lr_scheduler_type", "cosin"], "--lr_scheduler_type 'cosin' is not a transformers scheduler; "
                                                 "choose one of .*'cosine', .*'cosine_with_min_lr'"),
        (None, ["--lr_scheduler_type", "cosine_with_min_lr"], "cannot start: .*min_lr"),
        (None, ["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}'],
         "cannot start: .*min_lr_rate"),
        (None, ["--overwrite_output_dir", "--resume_from_checkpoint", "latest"], "give one"),
        (None, ["--max_train_samples", "0"], "--max_train_samples must be at least 1, got 0"),
        (None, ["--eval_strategy", "epoch", "--max_eval_samples", "-2"], "--max_eval_samples must be at least 1"),
        (None, ["--model_name_or_path", "gpt2", "--config_overrides", "vocab_size=50304"],
         "--config_overrides changes a --model_config trained from scratch"),
        pytest.param(None, ["--task", "image-classification", "--config_overrides", "num_labels=3"],
                     f"--config_overrides is for --task {' or '.join(flag_owners('config_overrides'))}, not image-classification",
                     marks=pytest.mark.parts("images", "sft")),
    ],
)
def test_bad_arguments_are_named(tmp_path, recipe_text, argv, message) -> None:
    if recipe_text is not None:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(recipe_text)
        argv = ["--config", str(recipe), *argv]
    with pytest.raises(ArgumentError, match=message):
        parse_args([*argv, "--output_dir", str(tmp_path / "out")])


@pytest.mark.quick
@pytest.mark.parametrize(("flag", "value"), [("--optim", "adamw"), ("--task", "text"),
                                             ("--eval_strategy", "epochs"), ("--save_strategy", "step")])
def test_unknown_names_are_one_line_with_the_valid_names_before_anything_is_built(tmp_path, flag, value) -> None:
    with pytest.raises(ArgumentError) as refused:  # train.py: one `error:` line, exit 2
        parse_args([flag, value, "--output_dir", str(tmp_path)])
    assert f"invalid choice: '{value}' (choose from" in str(refused.value) and str(refused.value).startswith(f"argument {flag}")
    assert "\n" not in str(refused.value)


@pytest.mark.quick
def test_optimizer_and_schedule_flags_reach_the_torch_objects(tmp_path) -> None:
    _, _, args = parse_args(["--optim", "adamw_torch", "--adam_beta1", "0.8", "--adam_beta2", "0.99",
                             "--adam_epsilon", "1e-6", "--warmup_ratio", "0.25", "--learning_rate", "0.1",
                             "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}',
                             "--output_dir", str(tmp_path)])
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, args)
    assert isinstance(optimizer, torch.optim.AdamW) and not optimizer.defaults["fused"]
    assert optimizer.defaults["betas"] == (0.8, 0.99) and optimizer.defaults["eps"] == 1e-6
    scheduler = build_scheduler(optimizer, args, total_steps=20)
    rates = []
    for _ in range(20):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[5] == pytest.approx(0.1)  # warmup: ceil(0.25 * 20) = 5 steps
    assert rates[4] < 0.1
    assert min(rates[5:]) >= 0.01 - 1e-12  # cosine_with_min_lr stops at min_lr_rate x learning_rate
    assert scheduler.get_last_lr()[0] == pytest.approx(0.01)  # the end of the schedule


@pytest.mark.quick
@pytest.mark.parametrize(("optim", "kind"), [("sgd", torch.optim.SGD), ("adafactor", Adafactor),
                                             ("adamw_torch_fused", torch.optim.AdamW)])
def test_each_optimizer_name_builds_its_optimizer(tmp_path, optim, kind) -> None:
    _, _, args = parse_args(["--optim", optim, "--output_dir", str(tmp_path)])
    optimizer = build_optimizer(torch.nn.Linear(4, 4), args)
    assert type(optimizer) is kind
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]  # no decay on the bias


def build_cpu_adam_without_compiler(tmp_path) -> subprocess.CompletedProcess:
    """A real CPU Adam build (ZeRO offload's optimizer), with a compiler that fails, in a fresh interpreter."""
    probe = ("import sys, torch; from training.arguments import parse_args; from training.optim import build_optimizer\n"
             "from training.errors import StrategyError\n"
             f"_, _, args = parse_args(['--output_dir', {str(tmp_path)!r}])\n"
             "try: build_optimizer(torch.nn.Linear(2, 2), args, offloaded=True)\n"
             "except StrategyError as error: print('StrategyError:', error)")
    return subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ops"), "CXX": "/bin/false"})


def test_a_cpu_adam_that_cannot_build_is_one_clear_error(tmp_path) -> None:
    """Under ZeRO offload DeepSpeed compiles its CPU Adam on first use; without a compiler that is a StrategyError
    (train.py's one error line), not DeepSpeed's chained tracebacks."""
    result = build_cpu_adam_without_compiler(tmp_path)
    assert "StrategyError: DeepSpeed's CPU Adam, which steps the optimizer under ZeRO optimizer offload, failed to " \
           "build (" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "install a C++ compiler and ninja" in result.stdout


@pytest.mark.quick
@pytest.mark.parametrize("strategy", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_adafactor_is_refused_where_the_optimizer_sees_shards(tmp_path, monkeypatch, strategy) -> None:
    monkeypatch.setenv(strategy, "true")
    with pytest.raises(ArgumentError, match="--optim adafactor factors whole weight matrices"):
        parse_args(["--optim", "adafactor", "--output_dir", str(tmp_path)])


@pytest.mark.quick
@pytest.mark.parametrize("flag", [pytest.param("--teacher_model_name_or_path", marks=pytest.mark.parts("distillation")),
                                  "--model_name_or_path", "--train_file"])
def test_an_overwrite_that_would_delete_what_the_run_reads_is_refused_before_anything_is_deleted(tmp_path, flag) -> None:
    """The README's distillation recipe read its teacher from outputs/default/final: --overwrite_output_dir
    there deleted the teacher (8 minutes of training) and exported a 5-step student in its place."""
    final = tmp_path / "out" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    read = final / "corpus.txt" if flag == "--train_file" else final
    if flag == "--train_file":
        read.write_text("a document\n")
    with pytest.raises(ArgumentError, match=f"--overwrite_output_dir would delete {final}, which {flag} .*another "
                                            "--output_dir"):
        parse_args([flag, str(read), "--overwrite_output_dir", "--output_dir", str(tmp_path / "out")])
    assert (final / "config.json").exists()
    (tmp_path / "out" / "corpus.txt").write_text("a document\n")  # beside the run's outputs: not deleted, allowed
    parse_args(["--train_file", str(tmp_path / "out" / "corpus.txt"), "--overwrite_output_dir", "--output_dir",
                str(tmp_path / "out")])


@pytest.mark.quick
@pytest.mark.parametrize(("steps", "flags", "warning"), [
    (1, [], None),  # the default warmup, 10% rounded down: none in a 1-step run, which then learns
    (12, [], None),
    (1, ["--warmup_steps", "30"], "every one of the 1 steps trains at learning rate 0"),
    (5, ["--warmup_steps", "10"], "warmup of 10 steps covers the whole run of 5: step 1 trains at learning rate 0"),
    (12, ["--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "2"], None),  # step 1 only: a warmup's start
    (3, ["--lr_scheduler_type", "linear", "--warmup_ratio", "0.5"], None),
])
def test_a_schedule_that_trains_steps_at_learning_rate_zero_is_named(tmp_path, caplog, steps, flags, warning) -> None:
    """30 chat examples under fsdp.yaml made a 1-step run that a 30-step warmup kept at learning rate 0, silently."""
    from accelerate import PartialState

    from training.optim import warmup_steps

    PartialState(cpu=True)  # accelerate's logger: the main process of one
    _, _, args = parse_args([*flags, "--output_dir", str(tmp_path)])
    with caplog.at_level("WARNING"):
        build_scheduler(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=args.learning_rate), args, steps)
    said = [record.getMessage() for record in caplog.records if "learning rate" in record.getMessage()]
    assert said == [] if warning is None else (len(said) == 1 and warning in said[0]), said
    if not flags:
        assert warmup_steps(args, steps) == int(0.1 * steps)


GIVEN_AS = {  # the ways a user gives --learning_rate 1e-3, the core's default
    "command line": lambda recipe: ["--learning_rate", "1e-3"],
    "command line, with =": lambda recipe: ["--learning_rate=0.001"],
    "recipe file": lambda recipe: ["--config", str(recipe)],
}


@pytest.mark.quick
@pytest.mark.parts("dpo")
@pytest.mark.parametrize("given_as", [*GIVEN_AS, None])
def test_a_part_default_never_replaces_a_value_given_equal_to_the_core_default(tmp_path, given_as) -> None:
    """`--task dpo --learning_rate 1e-3` trained at DPO's own 5e-5: "given" was decided by comparing the value with
    the core's default. Given is named, whatever its value."""
    from parts.dpo.flags import LEARNING_RATE

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.001\n")
    flags = GIVEN_AS[given_as](recipe) if given_as else []
    _, _, args = parse_args(["--task", "dpo", "--reference_free", *flags, "--output_dir", str(tmp_path / "out")])
    assert args.learning_rate == (1e-3 if given_as else LEARNING_RATE)
    assert ("learning_rate" in args.given) == bool(given_as)


@pytest.mark.quick
@pytest.mark.parametrize(("given", "refused"), [
    ((), None), (("--max_grad_norm", "1.0"), None), (("--lr_scheduler_kwargs", "{}"), None),
    (("--max_grad_norm", "1.0", "--lr_scheduler_kwargs", "{}"), "--lr_scheduler_kwargs {} with --max_grad_norm"),
    (("--logging_first_step", "--lr_scheduler_kwargs", "{}"), "--lr_scheduler_kwargs {} with --logging_first_step"),
    (("--logging_first_step", "false", "--lr_scheduler_kwargs", "{}"), None),  # a switch given as false is off
])
def test_a_declared_conflict_refuses_only_flags_given(tmp_path, monkeypatch, given, refused) -> None:
    """--lr_scheduler_kwargs' default None is normalised to {}, which counted as given: a part that declared a
    conflict with it refused every run. Both flags given at their defaults are a conflict; either alone is not."""
    from training import arguments
    from training.parts import Conflict, Part

    class Clashing(Part):
        name = "clashing"
        description = "a part that cannot run with a schedule's own arguments and clipping or a first-step log"
        conflicts = (Conflict("lr_scheduler_kwargs", "max_grad_norm", ": drop one"),
                     Conflict("lr_scheduler_kwargs", "logging_first_step", ": drop one"))

    installed = arguments.installed_parts()
    monkeypatch.setattr(arguments, "installed_parts", lambda: (*installed, Clashing()))
    argv = [*given, "--output_dir", str(tmp_path)]
    if refused:
        with pytest.raises(ArgumentError, match=f"^{re.escape(refused)} is not supported: drop one$"):
            parse_args(argv)
    else:
        parse_args(argv)


@pytest.mark.quick
@pytest.mark.parts("dpo", "sft")
def test_a_flag_of_another_task_is_refused_even_at_its_default(tmp_path) -> None:
    with pytest.raises(ArgumentError, match="--beta is for --task dpo, not sft"):
        parse_args(["--task", "sft", "--beta", "0.1", "--output_dir", str(tmp_path)])
    parse_args(["--task", "sft", "--output_dir", str(tmp_path)])
