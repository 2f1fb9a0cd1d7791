"""Owns how optional features (parts/) join the core: the hook points, and finding the parts installed.

A part is a package `parts/<name>/` whose `__init__.py` defines `PART = Part(...)`: its flags (a
dataclass, mixed into TrainArguments; `model_flags` into ModelArguments, `data_flags` into DataArguments),
the tasks it adds to `--task` (`TaskEntry`), and the hooks it fills. The core calls each hook point for
every part installed, in name order, and never branches on a part by name; a fork leaves a part
out by deleting its folder. As torchtitan's model converters and transformers' callbacks, a hook is
a named point of the fixed run, not a second loop.

The hook points are `Part`'s fields, in the order a run meets them, each with what it is given and returns
(`args`: TrainArguments); a hook a part leaves None is not called.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

Hook = Callable[..., Any] | None  # a hook point: `Part`'s fields below


@dataclass(frozen=True)
class TaskEntry:
    """One `--task`: its implementation, named configs, default config and own flags (training/task_registry.py)."""

    implementation: str  # "module:Class" of a training.tasks.Task subclass, imported when the task is built
    configs: Mapping[str, object]  # what --model_config may name for this task (e.g. models/configs.py)
    default_config: str
    own_flags: tuple[str, ...] = ()  # flags only this task (and others listing them) reads: refused for another
    data_columns: tuple[frozenset[str], ...] = ()  # column sets that mark a dataset as this task's (named if misused)

    def load(self) -> type:
        """The training.tasks.Task subclass (training/parts.py imports no task: tasks import the parts' hooks)."""
        module, name = self.implementation.split(":")
        return getattr(importlib.import_module(module), name)


class TextSource(ABC):
    """A part's source of a text task's training and evaluation sequences (`text_source` hook), built from the
    data flags."""

    flag: str  # the flag that chose it (named when two are given)

    def block_size(self) -> int | None:
        """The block size the data fixes (shards cut for one), or None."""
        return None

    @abstractmethod
    def load(self, seed: int) -> object:
        """What is read before the model is built (the main process first), for `datasets`."""

    @abstractmethod
    def datasets(self, raw, tokenizer, block_size: int, main_process_first) -> tuple:
        """The training set (a stream: one the part's `train_loader` reads) and the evaluation set."""


class ModelRunner(ABC):
    """A model that a part wraps and runs itself (pipeline stages: each process holds some layers). The core
    hands it the steps it would take with a plain model, and never asks which part made it."""

    @abstractmethod
    def prepare(self, accelerator: Accelerator, task, seed: int, optimizer, train_loader, eval_loader,
                scheduler) -> tuple:
        """What `accelerator.prepare(model, optimizer, train_loader, eval_loader, scheduler)` returns."""

    @abstractmethod
    def forward_backward(self, accelerator: Accelerator, batch: dict, window_targets: torch.Tensor) -> torch.Tensor:
        """One micro-step (training/loss.py `forward_backward`'s contract)."""

    @abstractmethod
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the whole model's gradient norm; return the norm before clipping."""

    @abstractmethod
    def evaluate(self, dataloader, accelerator: Accelerator, task) -> dict[str, float]:
        """training/evaluation.py `evaluate`'s figures."""

    @abstractmethod
    def export(self, accelerator: Accelerator, processor, final_dir) -> object:
        """The whole model in `final_dir`, as training/checkpoint.py `export_final` writes it."""


@dataclass(frozen=True)
class Part:
    """One optional feature: its name and one line about it, its flags, and the hooks it fills (None: not used)."""

    name: str
    description: str  # one line
    flags: type | None = None  # a dataclass whose fields (all with defaults) become train.py flags
    model_flags: type | None = None  # the same, for the model flags (ModelArguments)
    data_flags: type | None = None  # the same, for the data flags (DataArguments)
    tasks: Mapping[str, TaskEntry] | None = None  # --task names it adds
    # its flags that only these tasks read (--task name -> flags): refused for another task, as a task's own flags
    task_flags: Mapping[str, tuple[str, ...]] | None = None
    run_inputs: tuple[str, ...] = ()  # its flags that name files or directories the run reads
    # what scripts/new_project.py leaves out with it, beyond parts/<name>/, tests/test_<name>.py, docs/<name>.md
    files: tuple[str, ...] = ()  # other files it owns (scripts, figures, tests under other names)
    requirements: tuple[str, ...] = ()  # packages of requirements.txt only it needs
    before_imports: Hook = None  # (): train.py's first call, before the libraries load (stop signals handled)
    check_flags: Hook = None  # (model_args, data_args, args): after the core's own checks; raises ArgumentError
    # (strategy, on_cpu): before the Accelerator and DeepSpeed start, and before DeepSpeed's CPU Adam builds
    at_start: Hook = None
    building_extension: Hook = None  # (name): before DeepSpeed's CPU Adam ("cpu_adam") compiles or loads
    # (args, strategy, processes, on_cpu): before the process group (and in the dry run); raises StrategyError
    check_launch: Hook = None
    # (accelerator, args) -> str | None: the process group up, on every rank (a collective may run): a line to log
    started: Hook = None
    # (accelerator, args, checkpoint dir): about to resume, before the model is built (a micro-batch it recorded)
    resuming: Hook = None
    # (data_args) -> TextSource | None: a text task's sequences, when the flags choose a part's source (a stream)
    text_source: Hook = None
    loader_settings: Hook = None  # (args) -> dict: DataLoader keyword arguments (a `worker_init_fn`)
    # (accelerator, train_set, task, args, loading) -> loader | None: batches of a set the core's DataLoader cannot
    # read (a stream: no length), given the DataLoader settings; it keeps its own position
    train_loader: Hook = None
    # (checkpoint, deepspeed) -> context manager: what a resume loads the checkpoint within (an unpickling allow-list)
    loading_checkpoint: Hook = None
    # (model_args, args) -> str | None: this part's flag that splits one model over processes or devices, if set
    model_split: Hook = None
    accelerator_settings: Hook = None  # (args) -> dict: `Accelerator` keyword arguments (accelerate's dynamo plugin)
    processes_per_replica: Hook = None  # (args) -> int: processes that read the same batches (a pipeline's stages)
    ddp_settings: Hook = None  # (args, on_cpu) -> dict: `DistributedDataParallelKwargs` fields
    # (model, accelerator, args) -> model: as the task built it, before adapters and `prepare` (kernels swapped in)
    convert_model: Hook = None
    # (model, model_args, args) -> model: after the seed, before `prepare`: parameters added or frozen (an adapter)
    adapt_model: Hook = None
    # (model, accelerator, args) -> model: the model laid out (tp slices), kept, or replaced by a `ModelRunner`
    wrap_model: Hook = None
    checkpoint_layout: Hook = None  # (args) -> dict: how the model is cut, recorded; a resume must match it
    held_parameters: Hook = None  # (model, args) -> int | None: the most parameters one process holds (dry run)
    # (model, accelerator, task, args) -> objective | None: after `prepare`, the task's own objective computed
    # another way (a fused loss): loss sums `objective(model, batch)`, per example or one for the micro-batch
    label_objective: Hook = None
    # (objective, accelerator, task, strategy, args) -> (objective, figures | None): the micro-step's loss sums
    # `objective(model, batch)`, kept, wrapped, compiled or replaced (distillation)
    training_objective: Hook = None
    # (prepared, accelerator, task, objective, train_set, args, prepare_training, loader_for, resumed) -> prepared:
    # (model, optimizer, loaders, scheduler, torch optimizer), kept or prepared again for another micro-batch
    micro_batch: Hook = None
    # (accelerator, model, torch optimizer, args) -> figures | None: before the first step (hooks registered, state
    # added to checkpoints); `figures(steps_run)`, called on every rank at the end, adds to summary.json
    after_prepare: Hook = None
    # (accelerator, task, ranks_per_batch) -> SpeedFigures | None: figures beside the throughput, on every rank (a
    # collective may run), logged each interval and summed up in summary.json (MFU: parts/mfu)
    speed_figures: Hook = None
    # (accelerator, args, current_step) -> context manager: what the loop runs within (a timed-out collective)
    around_training: Hook = None
    # (step, now, args) -> str | None: after each optimizer step, on every rank: why to save and stop now (a signal),
    # agreed by all ranks (a collective, at least when `now`: a step that logs, evaluates or saves)
    stop_requested: Hook = None
    # (final_dir, processor, model_args, args): main process, once `final/` is written (a merged model)
    after_export: Hook = None
    # (args, title): main process, when a run ends or stops, metrics.jsonl and summary.json written (report.png)
    run_ended: Hook = None
    # (task, model, model_args, args, strategy, processes, compute_dtype) -> list[str]: the dry run's added lines
    dry_run_lines: Hook = None


@functools.cache
def installed_parts() -> tuple[Part, ...]:
    """Every part under parts/, in name order (none when the folder is gone)."""
    try:
        package = importlib.import_module("parts")
    except ModuleNotFoundError:
        return ()
    found = (importlib.import_module(f"parts.{module.name}").PART
             for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda module: module.name))
    return tuple(found)


def installed(name: str) -> bool:
    """Whether the part `name` is in this project (a fork may have left it out: scripts/new_project.py)."""
    return any(part.name == name for part in installed_parts())


def part_flags(kind: str = "flags") -> tuple[type, ...]:
    """The parts' flag dataclasses of one `kind` (`flags`, `model_flags`, `data_flags`), mixed into TrainArguments,
    ModelArguments and DataArguments (training/flags.py)."""
    return tuple(flags for part in installed_parts() if (flags := getattr(part, kind)) is not None)


def part_tasks() -> dict[str, TaskEntry]:
    """The tasks the parts add to `--task`."""
    return {name: entry for part in installed_parts() for name, entry in (part.tasks or {}).items()}


def part_task_flags() -> dict[str, tuple[str, ...]]:
    """The parts' flags each task reads besides its own (a task no part installed adds is left out later)."""
    flags: dict[str, tuple[str, ...]] = {}
    for part in installed_parts():
        for task, names in (part.task_flags or {}).items():
            flags[task] = flags.get(task, ()) + names
    return flags


def run_inputs() -> tuple[str, ...]:
    """The parts' flags that name what a run reads."""
    return tuple(flag for part in installed_parts() for flag in part.run_inputs)


# The core calls a hook point by its name (a field of `Part`) through one of these.


def filled(hook: str) -> list[Callable]:
    """The `hook` of every installed part that fills it, in name order."""
    return [function for part in installed_parts() if (function := getattr(part, hook)) is not None]


def each(hook: str, *args) -> list:
    """What every installed part's `hook` returns for `args`, in name order."""
    return [function(*args) for function in filled(hook)]


def found(hook: str, *args) -> list:
    """`each`'s answers that are not None or empty (the text sources, the loaders, the splits the flags chose)."""
    return [answer for answer in each(hook, *args) if answer]


def through(hook: str, value, *args):
    """`value` passed through every part's `hook` in turn: `value = hook(value, *args)` (a model converted)."""
    for function in filled(hook):
        value = function(value, *args)
    return value


def merged(hook: str, *args) -> dict:
    """The dicts every part's `hook` returns, merged (a later part's value for the same key wins)."""
    return {key: value for answer in each(hook, *args) for key, value in answer.items()}
