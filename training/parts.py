"""Owns how optional features (parts/) join the core: the hook points, and finding the parts installed.

A part is a package `parts/<name>/` whose `__init__.py` defines `PART = Part(...)`: its flags (a
dataclass, mixed into TrainArguments; `model_flags` into ModelArguments, `data_flags` into DataArguments),
the tasks it adds to `--task` (`TaskEntry`), and the hooks it fills. The core calls each hook point for
every part installed, in name order, and never branches on a part by name; a fork leaves a part
out by deleting its folder. As torchtitan's model converters and transformers' callbacks, a hook is
a named point of the fixed run, not a second loop.

Hook points, in the order a run meets them (`args`: TrainArguments):
- `before_imports()`: train.py's first call, before the libraries load (stop signals handled).
- `check_flags(model_args, data_args, args)`: after the core's own checks of the flags; raises ArgumentError.
  (A part's `run_inputs` name its flags that point at files the run reads: `--overwrite_output_dir`
  refuses to delete them.)
- `at_start(strategy, on_cpu)`: before the Accelerator and DeepSpeed start (start-up work skipped), and before
  DeepSpeed's CPU Adam builds.
- `check_launch(args, strategy, processes, on_cpu)`: before the process group (and in the dry run);
  raises StrategyError for a launch the part cannot run in.
- `started(accelerator, args) -> str | None`: once the process group is up, on every rank (a collective may
  run): a line for the log (the preflight's map of ranks).
- `resuming(accelerator, args, checkpoint)`: a run about to resume from `checkpoint` (a directory), before the
  model is built: settings the checkpoint recorded (the micro-batch a search found).
- `text_source(data_args) -> TextSource | None`: where a text task's sequences come from, when the flags
  choose a part's source (a stream, pre-tokenised shards) over the core's documents loaded whole.
- `loader_settings(args) -> dict`: DataLoader keyword arguments (a `worker_init_fn`).
- `train_loader(accelerator, train_set, task, args, loading) -> loader | None`: the training batches of a set the
  core's DataLoader cannot read (a stream: no length), given the DataLoader settings; it keeps its own position.
- `loading_checkpoint(checkpoint, deepspeed) -> context manager`: what a resume loads the checkpoint within
  (an allow-list for unpickling).
- `model_split(model_args, args) -> str | None`: the flag that splits one model over several processes
  or devices, if this part's does (other features refuse to combine with a split model).
- `accelerator_settings(args) -> dict`: `Accelerator` keyword arguments (accelerate's dynamo plugin).
- `processes_per_replica(args) -> int`: processes that read the same batches (a pipeline's stages).
- `ddp_settings(args, on_cpu) -> dict`: DDP's settings (`DistributedDataParallelKwargs` fields).
- `convert_model(model, accelerator, args) -> model`: the model as the task built it, before
  adapters, layouts and `prepare` (kernels swapped in, modules rewritten).
- `adapt_model(model, model_args, args) -> model`: after the seed (every rank draws alike), before tensor
  parallelism and `prepare`: parameters added or frozen (an adapter). The dry run calls it too.
- `wrap_model(model, accelerator, args) -> model`: the model built and laid out, kept, or replaced by
  a `ModelRunner` (below) that runs it; `checkpoint_layout(args) -> dict` names how it is cut, which
  a checkpoint records and a resume must match; `held_parameters(model, args) -> int | None` is the
  most parameters one process then holds (the dry run's plan).
- `training_objective(objective, accelerator, task, strategy, args) -> (objective, figures or None)`: the
  micro-step's per-example loss sums `objective(model, batch)`, kept, compiled or replaced (distillation); after
  `prepare`.
- `micro_batch(prepared, accelerator, task, objective, train_set, args, prepare_training, loader_for, resumed)
  -> prepared`: the prepared (model, optimizer, train and eval loaders, scheduler, torch optimizer), kept or
  prepared again for another micro-batch (`prepare_training(module)`, `loader_for(micro_batch)`; the search for
  one that fits).
- `after_prepare(accelerator, model, optimizer, args) -> figures or None`: the prepared model (and the torch
  optimizer that steps), before the first
  step (hooks registered, state added to checkpoints). `figures(steps_run)`, called on every rank at the end,
  adds to summary.json.
- `around_training(accelerator, args, current_step) -> context manager`: what the training loop runs within
  (a timed-out collective turned into one error line).
- `stop_requested(step, now, args) -> str | None`: after each optimizer step, on every rank: why to save and
  stop now (a signal), agreed by all ranks (a collective, at least when `now`: a step that logs, evaluates or saves).
- `after_export(final_dir, processor, model_args, args)`: on the main process, once `final/` is written
  (a merged model beside an adapter).
- `run_ended(args, title)`: on the main process when a run ends, finished or stopped by a signal, once metrics.jsonl
  and summary.json are written (report.png).
- `dry_run_lines(task, model, model_args, args, strategy, processes, compute_dtype) -> list[str]`: lines the
  dry run's plan adds (the memory per rank, a teacher's, the pipeline's stages).
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

    from training.strategy import Strategy


@dataclass(frozen=True)
class TaskEntry:
    """One `--task`: its implementation, named configs, default config and own flags (training/task_registry.py)."""

    implementation: str  # "module:Class" of a training.tasks.Task subclass, imported when the task is built
    configs: Mapping[str, object]  # what --model_config may name for this task (e.g. models/configs.py)
    default_config: str
    own_flags: tuple[str, ...] = ()  # only this task (and others listing them) reads these; set for another, they are refused
    data_columns: tuple[frozenset[str], ...] = ()  # column sets that mark a dataset as this task's (named when another task is given it)

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
    before_imports: Callable[[], None] | None = None
    check_flags: Callable[[Any, Any, Any], None] | None = None
    at_start: Callable[[Strategy, bool], None] | None = None
    check_launch: Callable[[Any, Strategy, int, bool], None] | None = None
    started: Callable[[Accelerator, Any], str | None] | None = None
    resuming: Callable[[Accelerator, Any, Any], None] | None = None
    text_source: Callable[[Any], TextSource | None] | None = None
    loader_settings: Callable[[Any], dict] | None = None
    train_loader: Callable[..., object | None] | None = None
    loading_checkpoint: Callable[[Any, bool], Any] | None = None
    model_split: Callable[[Any, Any], str | None] | None = None
    accelerator_settings: Callable[[Any], dict] | None = None
    processes_per_replica: Callable[[Any], int] | None = None
    ddp_settings: Callable[[Any, bool], dict] | None = None
    convert_model: Callable[[torch.nn.Module, Accelerator, Any], torch.nn.Module] | None = None
    adapt_model: Callable[[torch.nn.Module, Any, Any], torch.nn.Module] | None = None
    wrap_model: Callable[[torch.nn.Module, Accelerator, Any], torch.nn.Module] | None = None
    checkpoint_layout: Callable[[Any], dict[str, int]] | None = None
    held_parameters: Callable[[torch.nn.Module, Any], int | None] | None = None
    training_objective: Callable[..., tuple[Callable, Callable[[int], dict] | None]] | None = None
    micro_batch: Callable[..., tuple] | None = None
    after_prepare: Callable[[Accelerator, torch.nn.Module, Any, Any], Callable[[int], dict] | None] | None = None
    around_training: Callable[[Accelerator, Any, Callable[[], int]], Any] | None = None
    stop_requested: Callable[[int, bool, Any], str | None] | None = None
    after_export: Callable[[Any, Any, Any, Any], None] | None = None
    run_ended: Callable[[Any, str], None] | None = None
    dry_run_lines: Callable[..., list[str]] | None = None


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
