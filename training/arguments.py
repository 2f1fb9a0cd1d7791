"""Command-line flags and `--config recipe.yaml`: defaults < recipe YAML < command line. A key the template does not
know is an error, in the recipe as on the command line, with the nearest valid name."""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Iterable
from itertools import chain
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import yaml
from transformers import SchedulerType  # not in training/flags.py: it loads torch, and --help must not

from data import check_data_file
from models.language import first_line
from training.checkpoints.files import check_output_dir
from training.strategy import Strategy, requested_strategy
from training.flags import (ALL_ARGUMENT_CLASSES, FLAG_CLASSES, KNOWN_KEYS, ArgumentError, DataArguments, ModelArguments,
                            TrainArguments, build_parser, every_flag)
from training.metrics import resolve_trackers
from training.optim import OPTIMIZERS, check_optimization
from training.parts import Flags, PartFlags, installed_parts, part_flags, parts, run_inputs
from training.task_registry import flag_owners, task_entry, tasks

# Flags naming files or directories the run reads: --overwrite_output_dir must not delete them (a part marks its own)
RUN_INPUTS = ("model_name_or_path", "tokenizer_name", "dataset_name", "train_file", "validation_file", *run_inputs())

LAUNCHER_SETTINGS = {  # TrainingArguments flags that the accelerate config or `accelerate launch` sets here
    "bf16": "accelerate launch --mixed_precision bf16 ... train.py (or mixed_precision: bf16 in the accelerate yaml)",
    "fp16": "accelerate launch --mixed_precision fp16 ... train.py (GPUs only; bf16 is safer)",
    "deepspeed": "accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml train.py (or another ZeRO config)",
    "fsdp": "accelerate launch --config_file accelerate_configs/fsdp.yaml train.py",
    "mixed_precision": "give it to the launcher, before train.py: accelerate launch --mixed_precision bf16 ... train.py",
    "num_processes": "give it to the launcher, before train.py: accelerate launch --num_processes 8 ... train.py",
}


def _check_known(keys: list[str], where: str) -> None:
    for key in keys:
        if key in LAUNCHER_SETTINGS:
            raise ArgumentError(f"{key!r} in {where} is a launcher setting here: {LAUNCHER_SETTINGS[key]}")
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see train.py --help"
            raise ArgumentError(f"unknown key {key!r} in {where}{hint}")


def load_recipe(path: str) -> dict[str, Any]:
    """A flat YAML mapping of flag names to values."""
    try:
        recipe = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ArgumentError(f"recipe file not found: {path}") from None
    except yaml.YAMLError as error:
        raise ArgumentError(f"recipe {path} is not valid YAML: {error}".replace("\n", " ")) from None
    recipe = recipe or {}
    if not isinstance(recipe, dict):
        raise ArgumentError(f"recipe {path} must be a mapping of flag names to values")
    _check_known(list(recipe), f"recipe {path}")
    return recipe


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, TrainArguments]:
    """Parse defaults, then `--config recipe.yaml`, then the command line, and check them (`validate`)."""
    model_args, data_args, train_args = read_flags(sys.argv[1:] if argv is None else argv)
    validate(model_args, data_args, train_args)
    return model_args, data_args, train_args


def read_flags(argv: list[str]) -> tuple[ModelArguments, DataArguments, TrainArguments]:
    """The flags' values (defaults < recipe < command line), unchecked, and which of them were given."""
    parser = build_parser()
    pre_args, _ = parser.parse_known_args(argv)
    recipe = load_recipe(pre_args.config) if pre_args.config else {}
    words = recipe_words(recipe, pre_args.config)
    for key, given in words.items():  # each value alone, so that an error names the file and the key
        try:
            _, left = parser.parse_known_args(given)
        except ArgumentError as error:
            raise ArgumentError(f"recipe {pre_args.config}: {error}") from None
        if left:
            raise ArgumentError(f"recipe {pre_args.config}: {key} takes one value, got {recipe[key]!r}")
    namespace, unknown = parser.parse_known_args([*chain.from_iterable(words.values()), *argv])  # the command line wins
    if unknown:
        flags = [item.lstrip("-").split("=")[0] for item in unknown if item.startswith("--")]
        _check_known(flags or unknown, "the command line")
        raise ArgumentError(f"unexpected arguments {unknown}; see train.py --help")
    return arguments_of(vars(namespace), frozenset(recipe) | named_on_command_line(argv))


def recipe_words(recipe: dict[str, Any], path: str | None) -> dict[str, list[str]]:
    """The recipe as command-line words, so that its values get exactly the command line's parsing and errors (an
    integer flag given 2.5 is refused, not passed on), by key. A key left empty means its default where that is none
    (or no tracker); elsewhere it is refused."""
    words = {}
    for key, value in recipe.items():
        if value is None or value == []:
            if FIELD_DEFAULTS[key] is not None and key != "report_to":
                raise ArgumentError(f"recipe {path}: {key} is empty; give it a value (as on the command line), or "
                                    "delete the key to keep its default")
            continue
        words[key] = [f"--{key}", *(str(item) for item in value)] if isinstance(value, list) else [
            f"--{key}={json.dumps(value) if isinstance(value, dict) else value}"]
    return words


def named_on_command_line(argv: list[str]) -> frozenset[str]:
    """The flags `argv` names, whatever their values (`--flag value`, `--flag=value`, `--no_flag`): parsed with
    every default a marker, so that only what the command line sets differs from it."""
    parser, unset = build_parser(), object()
    parser.set_defaults(**{action.dest: unset for action in parser._actions})
    return frozenset(name for name, value in vars(parser.parse_known_args(argv)[0]).items() if value is not unset) - {
        "config", "help"}


def arguments_of(values: dict[str, Any], given: frozenset[str] = frozenset()) -> tuple[
        ModelArguments, DataArguments, TrainArguments]:
    """The parsed flag values as the three argument objects, each holding the same `parts` (every part's flags) and
    `given` (the flags the user named)."""
    model_args, data_args, train_args = (cls(**{f.name: values[f.name] for f in fields(cls) if f.init})
                                         for cls in ALL_ARGUMENT_CLASSES)
    model_args.parts = data_args.parts = train_args.parts = PartFlags(**{
        name: flags(**{f.name: values[f.name] for f in fields(flags)}) for name, flags in part_flags().items()})
    model_args.given = data_args.given = train_args.given = given
    return model_args, data_args, train_args


def validate(model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments) -> None:
    """Reject settings that cannot train, on every rank, before any process group starts."""
    positive = ["per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                "logging_steps", "eval_steps", "save_steps", "ddp_timeout"]
    for name in positive:
        if getattr(train_args, name) < 1:
            raise ArgumentError(f"--{name} must be at least 1, got {getattr(train_args, name)}")
    if train_args.max_steps < -1:
        raise ArgumentError(f"--max_steps must be -1 (train for --num_train_epochs) or a positive number of steps, "
                            f"got {train_args.max_steps}")
    if train_args.do_train and (train_args.max_steps == 0 or (train_args.max_steps == -1 and
                                                               train_args.num_train_epochs <= 0)):
        raise ArgumentError("nothing to train: set --max_steps > 0 or --num_train_epochs > 0 (or --do_train false to "
                            "evaluate only)")
    if not train_args.do_train and train_args.eval_strategy == "no":
        raise ArgumentError("--do_train false evaluates only, and --eval_strategy no turns evaluation off: drop one")
    check_optimization_flags(train_args)
    for name in ("max_train_samples", "max_eval_samples"):
        if (value := getattr(data_args, name)) is not None and value < 1:
            raise ArgumentError(f"--{name} must be at least 1, got {value}")
    if data_args.block_size is not None and data_args.block_size < 2:
        raise ArgumentError(f"--block_size must be at least 2, got {data_args.block_size}")
    if train_args.dataloader_num_workers is not None and train_args.dataloader_num_workers < 0:
        raise ArgumentError(f"--dataloader_num_workers must be >= 0, got {train_args.dataloader_num_workers}")
    if train_args.max_grad_norm < 0:
        raise ArgumentError("--max_grad_norm must be >= 0 (0 disables clipping)")
    if data_args.validation_file and not data_args.train_file:
        raise ArgumentError("--validation_file needs --train_file")
    check_task_flags(model_args, data_args)
    check_conflicts(model_args, data_args, train_args)
    parts().check_flags(Flags(model_args, data_args, train_args))
    if model_args.model_name_or_path and Path(model_args.model_name_or_path).is_dir():
        # absolute: an exported adapter names its base model by this path, to be found from anywhere
        model_args.model_name_or_path = str(Path(model_args.model_name_or_path).resolve())
    values = every_flag(model_args, data_args, train_args)
    check_output_dir(train_args.output_dir, train_args.resume_from_checkpoint, train_args.overwrite_output_dir,
                     {flag: values[flag] for flag in RUN_INPUTS}, evaluating=not train_args.do_train)
    report_to = train_args.report_to
    # a recipe may give one name as a string, or leave the key empty
    train_args.report_to = resolve_trackers([report_to] if isinstance(report_to, str) else report_to or ["none"])
    train_args.run_name = train_args.run_name or Path(train_args.output_dir).resolve().name
    for path in filter(None, (data_args.train_file, data_args.validation_file)):
        try:
            check_data_file(path)
        except (ValueError, FileNotFoundError) as error:
            raise ArgumentError(str(error)) from None


def check_optimization_flags(train_args: TrainArguments) -> None:
    """The optimizer and schedule settings work together, and with the launched strategy."""
    if train_args.lr_scheduler_type not in (names := [s.value for s in SchedulerType]):
        raise ArgumentError(f"--lr_scheduler_type {train_args.lr_scheduler_type!r} is not a transformers scheduler; "
                            f"choose one of {names}")
    if not 0 <= train_args.warmup_ratio < 1:
        raise ArgumentError(f"--warmup_ratio must be in [0, 1), got {train_args.warmup_ratio}")
    if train_args.warmup_steps is not None and train_args.warmup_steps < 0:
        raise ArgumentError(f"--warmup_steps must be >= 0, got {train_args.warmup_steps}")
    kwargs = train_args.lr_scheduler_kwargs
    if isinstance(kwargs, str):  # from the command line; a recipe may give a mapping
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as error:
            raise ArgumentError(f"--lr_scheduler_kwargs is not valid JSON ({error}); give an object such as "
                                '\'{"min_lr_rate": 0.1}\'') from None
    if not isinstance(kwargs, dict | None):
        raise ArgumentError(f"--lr_scheduler_kwargs must be a JSON object of argument names to values, got {kwargs!r}")
    train_args.lr_scheduler_kwargs = kwargs or {}
    if OPTIMIZERS[train_args.optim].needs_whole_tensors and requested_strategy() in (Strategy.FSDP, Strategy.DEEPSPEED):
        raise ArgumentError(f"--optim {train_args.optim} factors whole weight matrices, but {requested_strategy().value} "
                            "hands the optimizer shards; use it with ddp.yaml or single.yaml, or pick adamw_torch_fused")
    try:
        check_optimization(train_args)
    except (ValueError, TypeError) as error:
        detail = first_line(error)
        raise ArgumentError(f"--optim {train_args.optim} with --lr_scheduler_type {train_args.lr_scheduler_type} "
                            f"cannot start: {detail}; check --adam_beta1/--adam_beta2/--adam_epsilon and "
                            "--lr_scheduler_kwargs") from None


FIELD_DEFAULTS = {f.name: f.default if f.default_factory is MISSING else f.default_factory()
                  for cls in FLAG_CLASSES for f in fields(cls) if f.init}


def flags_given(args: ModelArguments | DataArguments | TrainArguments, names: Iterable[str]) -> list[str]:
    """Those of `names` the user gave, on the command line or in the recipe file, whatever the value: every check,
    conflict and part default decides "given" by this alone."""
    return [name for name in names if name in args.given]


def check_task_flags(model_args: ModelArguments, data_args: DataArguments) -> None:
    """The named config belongs to the task (default: the task's own), and no flag is meant for the other task."""
    task, chosen = model_args.task, task_entry(model_args.task)
    model_args.model_config = model_args.model_config or chosen.default_config
    if not model_args.model_name_or_path and chosen.configs and model_args.model_config not in chosen.configs:
        raise ArgumentError(f"unknown model_config {model_args.model_config!r} for --task {task}; choose one of "
                            f"{sorted(chosen.configs)}")
    others = sorted({flag for entry in tasks().values() for flag in entry.own_flags} - set(chosen.own_flags))
    if given := flags_given(model_args, others):
        owners = flag_owners(given[0])
        raise ArgumentError(f"--{given[0]} is for --task {' or '.join(owners)}, not {task}; drop it or set --task {owners[0]}")
    if data_args.dataset_name and data_args.train_file:
        raise ArgumentError("--dataset_name and --train_file exclude each other; give one")
    if len(sources := parts().text_source(data_args)) > 1:  # the parts' sources of text (a stream, pre-tokenised shards)
        raise ArgumentError(f"{sources[0].flag} with {sources[1].flag} is not supported: give one source of training text")
    if model_args.config_overrides and model_args.model_name_or_path:
        raise ArgumentError("--config_overrides changes a --model_config trained from scratch: drop it or --model_name_or_path")


def split_model(flags: Flags) -> str | None:
    """The first flag that splits one model over processes or devices (the parts': --device_map, pipeline stages)."""
    return next(iter(parts().model_split(flags)), None)


def check_conflicts(model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments) -> None:
    """The parts' declared conflicts (`Part.conflicts`): two flags given together that cannot run together (a switch
    given as false, `--use_peft false`, or a number given as 0, `--ema_decay 0`, is off: no conflict)."""
    values = every_flag(model_args, data_args, train_args)
    for part in installed_parts():
        for conflict in part.conflicts:
            given = flags_given(model_args, (conflict.flag, conflict.other))
            if len([name for name in given if values[name] is not False and values[name] != 0]) == 2:
                value = values[conflict.flag]
                shown = f"--{conflict.flag}" + ("" if value is True else f" {value}")
                raise ArgumentError(f"{shown} with --{conflict.other} is not supported{conflict.why}")
