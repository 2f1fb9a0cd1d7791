"""Owns the one registry of tasks (`--task`): implementation, named configs, default config, own flags. Task classes
are imported when a task is built, not with this module: `train.py --help` lists tasks and configs without torch."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from models.configs import NAMED_CONFIGS
from training.parts import TaskEntry, part_task_flags, part_tasks

if TYPE_CHECKING:
    from training.tasks import Task

# The text tasks' shared flags (a part's text task lists them too)
TEXT_FLAGS = ("tokenizer_name", "config_overrides", "train_file", "validation_file", "sample_prompt")
CORE_TASKS: dict[str, TaskEntry] = {"causal-lm": TaskEntry("training.tasks:CausalLM", NAMED_CONFIGS, "llama-small",
                                                           (*TEXT_FLAGS, "text_column", "block_size", "packing",
                                                            "sample_by", "keep_linebreaks"))}


@functools.cache
def tasks() -> dict[str, TaskEntry]:
    """Every `--task`, the core's then the parts', with the part flags it reads (not at import: parts import this)."""
    extra = part_task_flags()
    return {name: dataclasses.replace(entry, own_flags=entry.own_flags + extra.get(name, ()))
            for name, entry in {**CORE_TASKS, **part_tasks()}.items()}


def flag_owners(flag: str) -> list[str]:
    """The tasks that read `flag` (their own, or a part's for them), in `tasks()` order."""
    return [name for name, entry in tasks().items() if flag in entry.own_flags]


class TaskChoices(list):
    """--task's choices: the registered names, and any `module:Class` (argparse asks `in`; its message lists these)."""

    def __contains__(self, value: object) -> bool:
        return super().__contains__(value) or ":" in str(value)


@functools.cache
def task_entry(name: str) -> TaskEntry:
    """The registered task `name`, or your `module:Class`, which takes its registered ancestor's configs and flags plus
    its `own_flags`. Cached: several callers ask, and a class's entry imports every registered task."""
    if name in tasks():
        return tasks()[name]
    from training.errors import ArgumentError
    from training.tasks import Task

    own = TaskEntry(name, {}, "")
    try:
        task_class = own.load()
    except (ImportError, AttributeError, ValueError) as error:
        raise ArgumentError(f"--task {name}: cannot import it ({error}); give a registered task or module:Class, "
                            "a Task subclass importable from where you launch") from None
    if not (isinstance(task_class, type) and issubclass(task_class, Task)):
        raise ArgumentError(f"--task {name} is not a Task subclass (training/tasks.py); name the task class, not "
                            "its model or another object")
    # the closest registered ancestor (a subclass of a part's fine-tuning task is that task, not causal-lm)
    registered = {entry.load(): entry for entry in tasks().values()}
    base = next((registered[ancestor] for ancestor in task_class.__mro__ if ancestor in registered), own)
    return dataclasses.replace(base, implementation=name, own_flags=base.own_flags + tuple(task_class.own_flags))


def build_task(model_args, data_args) -> Task:
    return task_entry(model_args.task).load()(model_args, data_args)
