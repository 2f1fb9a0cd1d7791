"""Owns how optional features (parts/) join the core: the `Part` base class, whose methods are the hook points, and
finding the parts installed.

A part is a package `parts/<name>/` whose `__init__.py` defines `PART`, an instance of its own `Part` subclass: its
flags (a dataclass of its own, read as `args.parts.<name>`) and those it cannot run with, the tasks it adds to `--task`
(`TaskEntry`), and the hooks it overrides.
Every hook is a method of `Part` with a no-op default, declared once here with `@hook`: when the core calls it, what
it is handed (one context object of the point it is called at), and how the answers of several parts combine. The
core calls the hooks of every installed part at once through `parts()`, an object of the same class, and never
branches on a part by name; a fork leaves a part out by deleting its folder. As Lightning's callbacks and torchtitan's
model converters, a hook is a named point of the fixed run, not a second loop. Parts run in name order, except where
a part names the parts it follows (`after`).

When each runs, in the order a run meets them: `before_imports`, `check_flags`, `model_split`, `text_source`
(parsing, no process group); `at_start`, `check_launch`, `accelerator_settings`, `ddp_settings` (the launch);
`started`, `resuming`, `convert_model`, `adapt_model`, `wrap_model`, `model_runner`, `ranks_per_batch`,
`loader_settings`, `train_loader` (the model and data built); `optimizer_groups`, `lr_multiplier`, then `prepare`, then
`training_objective`, `micro_batch`, `after_prepare`, `checkpoint_layout` (prepared, before a resumed state is
loaded), `loading_checkpoint` and `load_state` (a resume), `logged_figures`; the loop: `around_training`, and per step
`after_backward` (each micro-batch), `after_optimizer_step`, `stop_requested`, `around_evaluation` (each evaluation),
`save_state` (each save); the end:
`around_export` (writing final/), `summary`, `run_ended`. The dry run: `held_parameters`, `dry_run_line`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, is_dataclass
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, ClassVar

from training.errors import ArgumentError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from training.flags import DataArguments, ModelArguments, TrainArguments
    from training.performance import LoggedFigures
    from training.runner import ModelRunner
    from training.strategy import Strategy
    from training.tasks import Task


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




@dataclass(frozen=True)
class Conflict:
    """Two flags that cannot run together, both given (`flags_given`; a switch given as false, a number as 0, is off): refused with
    "--<flag> <value> with --<other> is not supported<why>". `other` may be a flag of a part a project left out:
    never given."""

    flag: str
    other: str
    why: str


class PartFlags(SimpleNamespace):
    """Each installed part's flags, `args.parts.<part name>`: an instance of the part's own dataclass (`Part.flags`),
    the same object on the model, data and training arguments."""


class Combine(Enum):
    """How the answers of several parts' hook combine."""

    EACH = "each"  # every part's runs, for what it does; nothing is returned
    CHAIN = "chain"  # a value passed through every part's in turn: value = hook(value, context)
    MERGE = "merge"  # the dicts every part's returns, merged (a later part's value for the same key wins)
    ANSWERS = "answers"  # every answer that is not None, in order
    BY_PART = "by part"  # every answer that is not empty, by the name of the part that gave it
    ONE = "one"  # one part's answer at most, or None: two parts answering are refused in one line naming both


def hook(combine: Combine) -> Callable:
    """Declares a method of `Part` a hook point, and how several parts' answers combine."""

    def declared(method: Callable) -> Callable:
        method.combine = combine
        return method

    return declared


@dataclass(frozen=True)
class Flags:
    """The parsed flags, before any process group or library state."""

    model: ModelArguments
    data: DataArguments
    train: TrainArguments


@dataclass(frozen=True)
class Launch:
    """The launch as configured, before the process group: the flags, the strategy, the processes, the device."""

    args: TrainArguments
    strategy: Strategy
    processes: int
    on_cpu: bool


@dataclass(frozen=True)
class Started:
    """The process group up, on every rank (a collective may run), before the model is built."""

    accelerator: Accelerator
    args: TrainArguments
    resume: Path | None = None  # the checkpoint this run resumes, once known (`Part.resuming` on)


@dataclass(frozen=True)
class Training:
    """After `prepare`, on every rank: what trains, and how."""

    accelerator: Accelerator
    args: TrainArguments
    task: Task
    strategy: Strategy
    model: torch.nn.Module  # as prepared
    optimizer: torch.optim.Optimizer | None = None  # the torch optimizer inside the prepared one
    ranks_per_batch: int = 1  # ranks that read the same batches (a tensor-parallel group, a pipeline's stages)
    max_steps: int = 0  # the optimizer steps the run is planned to end at


@dataclass(frozen=True)
class Prepared:
    """What `prepare` made for training (training/setup.py `prepared_for_training`), by name."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer  # accelerate's (or DeepSpeed's) wrapper: the loop steps it
    train_loader: Iterable[dict]
    eval_loader: Iterable[dict]
    scheduler: torch.optim.lr_scheduler.LRScheduler
    torch_optimizer: torch.optim.Optimizer  # the torch optimizer inside `optimizer`


@dataclass(frozen=True)
class Schedule:
    """The learning-rate schedule being built, before `prepare`: its length and warmup, in optimizer steps."""

    args: TrainArguments
    total_steps: int
    warmup_steps: int


@dataclass(frozen=True)
class Grouping:
    """The optimizer's parameter groups being made, before the optimizer and its schedule."""

    model: torch.nn.Module  # as built and laid out, named (under ZeRO-3 already partitioned: each parameter 1-D)
    args: TrainArguments


@dataclass(frozen=True)
class MicroStep:
    """One micro-batch's forward and backward just run, on every rank. The core's runner ran the backward on its loss
    sum over `window_targets`, times the processes (training/step.py `forward_backward`): this rank's gradient of the
    micro-batch is processes / window_targets times its loss sum's (a part's runner says its own)."""

    accelerator: Accelerator
    model: torch.nn.Module  # as prepared
    batch: dict
    targets: torch.Tensor  # the micro-batch's targets (tokens) on this rank
    window_targets: torch.Tensor  # the window's, over every rank: the loss is the mean over them
    sync: bool  # the window's last micro-batch: the strategy has reduced the gradients over the processes


@dataclass(frozen=True)
class MicroBatchSearch:
    """What preparing again for another micro-batch takes (parts/batch_size)."""

    accelerator: Accelerator
    args: TrainArguments
    task: Task
    objective: Callable  # the micro-step's loss sums, as the parts made them
    train_set: object
    prepare_training: Callable[[torch.nn.Module], Prepared]  # the model prepared again, with the rest
    loader_for: Callable  # (dataset, batch size) -> the core's training DataLoader
    resumed: bool


@dataclass(frozen=True)
class Loading:
    """A training set the core's DataLoader may not read (a stream), and the DataLoader settings."""

    accelerator: Accelerator
    args: TrainArguments
    task: Task
    train_set: object
    settings: dict


@dataclass(frozen=True)
class Loop:
    """What the training loop runs within."""

    accelerator: Accelerator
    args: TrainArguments
    current_step: Callable[[], int]


@dataclass(frozen=True)
class OptimizerStep:
    """After an optimizer step, its scheduler step and the step counters, on every rank."""

    accelerator: Accelerator
    model: torch.nn.Module  # as prepared
    optimizer: torch.optim.Optimizer  # the torch optimizer inside the prepared one
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int  # the step just taken, from 1
    # the norm of the whole gradient before clipping, as clipping measured it: a 0-dim tensor on the device (a float
    # under DeepSpeed's CPU offload), read without a host sync
    grad_norm: torch.Tensor | float
    # the loss scaler skipped this update (fp16 overflow: the weights did not change): a 0-dim bool tensor on the device
    # under fp16, read without a host sync (`torch.where`), False otherwise
    skipped: torch.Tensor | bool = False


@dataclass(frozen=True)
class Evaluating:
    """An evaluation about to run (every `--eval_steps`, at the start and the end, and `--do_train false`'s)."""

    accelerator: Accelerator
    args: TrainArguments
    model: torch.nn.Module  # as prepared
    step: int


@dataclass(frozen=True)
class Exporting:
    """final/ about to be written, on every rank (the process group up: shards may be gathered)."""

    accelerator: Accelerator
    args: TrainArguments
    model: torch.nn.Module  # as prepared
    final_dir: Path


@dataclass(frozen=True)
class StepEnd:
    """After an optimizer step, on every rank."""

    args: TrainArguments
    step: int
    now: bool  # the step logs, evaluates or saves: a collective runs anyway


@dataclass(frozen=True)
class CheckpointFiles:
    """A checkpoint's directory, on every rank: being written (`save_state`), or resumed (`load_state`)."""

    accelerator: Accelerator
    directory: Path
    # being written: the run and step its files belong to, for a safetensors file's metadata (a resume compares them)
    stamp: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointLoad:
    """A checkpoint about to be loaded."""

    path: Path
    deepspeed: bool  # written by DeepSpeed's own save (before model_state/)


@dataclass(frozen=True)
class Finished:
    """The main process, once the run ended (`final_dir`: None where it stopped before exporting)."""

    args: TrainArguments
    model_args: ModelArguments
    title: str  # "<model>: <strategy, processes, precision>"
    final_dir: Path | None = None
    processor: object = None


@dataclass(frozen=True)
class Plan:
    """What the dry run planned, on rank 0 alone."""

    task: Task
    model: torch.nn.Module  # as built, before any strategy
    model_args: ModelArguments
    args: TrainArguments
    strategy: Strategy
    processes: int
    compute_dtype: torch.dtype
    held_parameters: int = 0  # the most one process holds (`Part.held_parameters`; 0 until asked)


class Part:
    """One optional feature: its name and one line about it, its flags, the tasks it adds, and the hooks it
    overrides. A subclass defines hooks only (its helpers live in its modules): `__init_subclass__` refuses others."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""  # one line
    # its flags: a dataclass whose fields (all with defaults) become train.py flags, read as `args.parts.<name>`
    flags: ClassVar[type | None] = None
    # flags of other parts or of the core it cannot run with: (its flag, the other, why), refused in one line
    conflicts: ClassVar[tuple[Conflict, ...]] = ()
    tasks: ClassVar[Mapping[str, TaskEntry]] = {}  # --task names it adds
    # its flags that only these tasks read (--task name -> flags): refused for another task, as a task's own flags
    task_flags: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    run_inputs: ClassVar[tuple[str, ...]] = ()  # its flags that name files or directories the run reads
    # its flags a resume cannot change (flag -> why: refused in one line); any other changed flag is honoured and logged
    fixed_on_resume: ClassVar[Mapping[str, str]] = {}
    # what scripts/new_project.py leaves out with it, beyond parts/<name>/, tests/test_<name>.py, docs/<name>.md
    # other files it owns (scripts, figures, tests under other names, core modules only parts use: those several parts
    # name stay while one of them is kept)
    files: ClassVar[tuple[str, ...]] = ()
    requirements: ClassVar[tuple[str, ...]] = ()  # packages of requirements.txt only it needs
    after: ClassVar[tuple[str, ...]] = ()  # parts whose hooks run before this one's (a chain's inner wrappers)
    needs: ClassVar[tuple[str, ...]] = ()  # parts whose modules it builds on: a project keeps them with it

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for attribute, value in vars(cls).items():
            method = isinstance(value, staticmethod | classmethod | property) or inspect.isfunction(value)
            if method and not attribute.startswith("__") and attribute not in HOOKS:
                raise TypeError(f"{cls.__name__}.{attribute} is not a hook of Part (training/parts.py): a part defines "
                                "hooks only; put helpers in its modules")
        if cls.flags is not None and not (isinstance(cls.flags, type) and is_dataclass(cls.flags)):
            raise TypeError(f"{cls.__name__}.flags is {cls.flags!r}: a part's flags are a dataclass (the class), whose "
                            "fields become train.py flags; read their values as args.parts.<name>")

    def __setattr__(self, attribute: str, value) -> None:
        """An instance attribute named as what `Part` declares (its `flags`, `name`, a hook) would hide it: refused."""
        if attribute in DECLARED:
            raise TypeError(f"{type(self).__name__}.{attribute} = ... would hide the part's declared {attribute} "
                            "(training/parts.py `Part`); give the attribute another name")
        super().__setattr__(attribute, value)

    # ---------------------------------------------------------------- flags and launch, before any process group

    @hook(Combine.EACH)
    def before_imports(self) -> None:
        """train.py's first call, before the libraries load (stop signals handled)."""

    @hook(Combine.EACH)
    def check_flags(self, flags: Flags) -> None:
        """After the core's own checks of the flags; raises ArgumentError."""

    @hook(Combine.ANSWERS)
    def model_split(self, flags: Flags) -> str | None:
        """This part's flag that splits one model over processes or devices, if set (the first answer is named)."""

    @hook(Combine.ANSWERS)
    def text_source(self, data: DataArguments) -> TextSource | None:
        """A text task's sequences, when the data flags choose this part's source (a stream); two are refused."""

    @hook(Combine.ANSWERS)
    def ranks_per_batch(self, args: TrainArguments) -> int | None:
        """Processes that read the same batches (a pipeline's stages, a tensor-parallel group): their product. At
        set-up, before the data loaders and `prepare`: it sizes the global batch."""

    @hook(Combine.BY_PART)
    def checkpoint_layout(self, args: TrainArguments) -> dict[str, object]:
        """How this part cuts the model, or settings of its own a run cannot change midway, as JSON values by name
        (its flag's, where a flag sets it), recorded in checkpoints: a resume that differs is refused in one line naming
        the part and the setting. After `prepare`, before a resume is loaded."""
        return {}

    @hook(Combine.EACH)
    def at_start(self, launch: Launch) -> None:
        """Before the Accelerator and DeepSpeed start, and before DeepSpeed's CPU Adam builds."""

    @hook(Combine.EACH)
    def check_launch(self, launch: Launch) -> None:
        """Before the process group (and in the dry run): the launch refused here raises StrategyError."""

    @hook(Combine.MERGE)
    def accelerator_settings(self, args: TrainArguments) -> dict:
        """`Accelerator` keyword arguments (accelerate's dynamo plugin), as it is built: after `check_launch`."""
        return {}

    @hook(Combine.MERGE)
    def ddp_settings(self, launch: Launch) -> dict:
        """`DistributedDataParallelKwargs` fields, as the Accelerator is built."""
        return {}

    # ---------------------------------------------------------------- the process group up: model and data

    @hook(Combine.ANSWERS)
    def started(self, run: Started) -> str | None:
        """On every rank (a collective may run), before the model is built: a line for the start-up log."""

    @hook(Combine.EACH)
    def resuming(self, run: Started) -> None:
        """About to resume `run.resume`, before the model is built (settings the checkpoint recorded)."""

    @hook(Combine.CHAIN)
    def convert_model(self, model: torch.nn.Module, run: Started) -> torch.nn.Module:
        """The model as the task built it, before adapters and `prepare` (kernels swapped in)."""
        return model

    @hook(Combine.CHAIN)
    def adapt_model(self, model: torch.nn.Module, flags: Flags) -> torch.nn.Module:
        """After the seed, before `prepare`: parameters added or frozen (an adapter); the dry run's too."""
        return model

    @hook(Combine.CHAIN)
    def wrap_model(self, model: torch.nn.Module, run: Started) -> torch.nn.Module:
        """The model laid out (layers over devices, tensor-parallel slices, this process's pipeline stages): after
        `adapt_model`, before `model_runner` and `prepare`."""
        return model

    @hook(Combine.ONE)
    def model_runner(self, model: torch.nn.Module, run: Started) -> ModelRunner | None:
        """A runner of this part's own for the laid-out model, in place of the core's (training/runner.py: pipeline
        stages train, evaluate, save and export their own way). One part's at most. After `wrap_model`, before
        `prepare`."""

    @hook(Combine.MERGE)
    def loader_settings(self, args: TrainArguments) -> dict:
        """DataLoader keyword arguments (a `worker_init_fn`), the process group up."""
        return {}

    @hook(Combine.ONE)
    def train_loader(self, loading: Loading) -> Iterable[dict] | None:
        """Batches of a training set the core's DataLoader cannot read (a stream: no length); it keeps its own
        position. One part's at most. Before `prepare`."""

    @hook(Combine.CHAIN)
    def optimizer_groups(self, groups: list[dict], grouping: Grouping) -> list[dict]:
        """The optimizer's parameter groups (`params`, `weight_decay`, optional `lr` and `name`) as the core split them
        (biases and norm scales without decay), regrouped before the optimizer and schedule are built, on every rank.
        A group's `lr` is its base rate, which the schedule scales; `name` names it in the logs (`lr/<name>`). The core
        then splits each group by dtype (ZeRO flattens a group into one buffer) and drops empty ones."""
        return groups

    @hook(Combine.ONE)
    def lr_multiplier(self, schedule: Schedule) -> Callable[[int], float] | None:
        """A learning-rate schedule of this part's own: the factor of --learning_rate at each step (0-based) from the
        end of warmup on. The core keeps the warmup (linear from 0, --warmup_steps/--warmup_ratio), the scheduler and
        its checkpoint state. One part's at most; --lr_scheduler_type given with it is refused. Before `prepare`
        (and again for each micro-batch `micro_batch` prepares)."""

    # ---------------------------------------------------------------- the training step

    @hook(Combine.CHAIN)
    def training_objective(self, objective: Callable, training: Training) -> Callable:
        """The micro-step's loss sums `objective(model, batch)`, kept, wrapped, compiled or replaced (in `after`
        order: a replacement first, a wrapper after it). Right after `prepare`, before `micro_batch`."""
        return objective

    @hook(Combine.CHAIN)
    def micro_batch(self, prepared: Prepared, search: MicroBatchSearch) -> Prepared:
        """What `prepare` made: kept, or prepared again for another micro-batch. After `training_objective`, before
        `after_prepare`."""
        return prepared

    @hook(Combine.EACH)
    def after_prepare(self, training: Training) -> None:
        """The final model and optimizer prepared (hooks registered, state to checkpoint made): before a resumed
        state is loaded (`load_state` then overwrites it) and before the first step."""

    @hook(Combine.ANSWERS)
    def logged_figures(self, training: Training) -> LoggedFigures | None:
        """Figures logged beside the loss and throughput each interval (MFU, DPO's rewards), on every rank (a
        collective may run). Asked once at the end of set-up, after a resume is loaded."""

    @hook(Combine.ANSWERS)
    def around_training(self, loop: Loop) -> AbstractContextManager | None:
        """What the training loop runs within (a collective that timed out, as one error line): entered after a
        resume is loaded and the step-0 evaluation, before the first step."""

    @hook(Combine.EACH)
    def after_backward(self, micro: MicroStep) -> None:
        """After each micro-batch's backward, on every rank; no host sync here. Before clipping and the optimizer step,
        except under DeepSpeed, whose engine clips and steps inside the backward of the window's last micro-batch
        (`micro.sync`). What `.grad` holds then is the strategy's (measured): DDP: this rank's sum over the window so
        far, averaged over the processes once `micro.sync`; FSDP2: None, then this rank's shard of the average (a
        DTensor); ZeRO-1: this rank's sum, then None; ZeRO-2/3: None (they reduce into buffers of their own). A
        micro-batch's own gradient on this rank, under every strategy: tensor hooks on the parameters (parts/gns)."""

    @hook(Combine.EACH)
    def after_optimizer_step(self, step: OptimizerStep) -> None:
        """After each optimizer step (its `scheduler.step()` and counters too), on every rank, before it is logged,
        evaluated or saved and before `stop_requested` (an average of the weights updated). No host sync here: a
        skipped update (`step.skipped`) is a device tensor."""

    @hook(Combine.ANSWERS)
    def stop_requested(self, end: StepEnd) -> str | None:
        """After each optimizer step and `after_optimizer_step`, on every rank: why to save and stop now (a signal),
        agreed by all ranks (a collective, at least when `end.now`); before the step's log, evaluation and save."""

    @hook(Combine.MERGE)
    def around_evaluation(self, evaluation: Evaluating) -> dict[str, AbstractContextManager]:
        """More passes of each evaluation, by metric prefix (`"eval_ema"`: eval_ema_loss, ...), each run within its
        context manager (other weights swapped in on entering, the trained ones back on leaving), on every rank,
        after the core's pass on the weights as trained (`eval_loss`, ...)."""
        return {}

    @hook(Combine.ANSWERS)
    def loading_checkpoint(self, checkpoint: CheckpointLoad) -> AbstractContextManager | None:
        """What a resume loads the checkpoint within (an unpickling allow-list): after `after_prepare`."""

    @hook(Combine.EACH)
    def save_state(self, checkpoint: CheckpointFiles) -> None:
        """On every rank, into the checkpoint being written, after the model's state: this part's own state (a
        stream's position, PowerSGD's error feedback, an average of the weights), in files of its own (the manifest
        lists and hashes them)."""

    @hook(Combine.EACH)
    def load_state(self, checkpoint: CheckpointFiles) -> None:
        """On every rank, from the checkpoint a run resumes, after `after_prepare` and the model's state, before the
        first step: this part's state restored alike on every rank, or refused in one line on every rank
        (ResumeError), whatever number of processes saved it."""

    # ---------------------------------------------------------------- the end of the run

    @hook(Combine.ANSWERS)
    def around_export(self, export: Exporting) -> AbstractContextManager | None:
        """What final/ is written within, on every rank, after the last step and evaluation (other weights swapped
        in and restored: an average's); entered in part order."""

    @hook(Combine.MERGE)
    def summary(self, steps_run: int) -> dict:
        """On every rank at the end, after `around_export` (a collective may run): figures this part adds to
        summary.json."""
        return {}

    @hook(Combine.EACH)
    def run_ended(self, finished: Finished) -> None:
        """Main process, when a run ends or stops, metrics.jsonl and summary.json written (report.png); `final/`
        written too where the run ended (`finished.final_dir`: a merged model)."""

    # ---------------------------------------------------------------- the dry run

    @hook(Combine.ANSWERS)
    def held_parameters(self, plan: Plan) -> int | None:
        """The most parameters one process holds, where this part cuts the model (the first answer is used)."""

    @hook(Combine.ANSWERS)
    def dry_run_line(self, plan: Plan) -> str | None:
        """A line the dry run adds to its plan."""


HOOKS: dict[str, Combine] = {name: value.combine for name, value in vars(Part).items() if hasattr(value, "combine")}
# what `Part` declares: an instance attribute of the same name would hide it
DECLARED = frozenset(HOOKS) | frozenset(Part.__annotations__)


class InstalledParts(Part):
    """Every installed part as one `Part`: each hook runs on every part that overrides it, in order, and the answers
    combine as the hook declares (`Combine`)."""

    def __init__(self, parts: Iterable[Part]) -> None:
        self.parts = tuple(parts)
        # each hook's overrides, found once: a hook no part overrides costs a call and an empty loop
        self.overrides = {hook: [part for part in self.parts if getattr(type(part), hook) is not getattr(Part, hook)]
                          for hook in HOOKS}


def _combined(name: str, combine: Combine) -> Callable:
    def every_part(self: InstalledParts, *arguments):
        overriding = self.overrides[name]
        hooks = [getattr(part, name) for part in overriding]
        if combine is Combine.ONE:
            answers = [(part, hook(*arguments)) for part, hook in zip(overriding, hooks)]
            answers = [(part, answer) for part, answer in answers if answer is not None]
            if len(answers) > 1:
                raise ArgumentError(f"parts/{answers[0][0].name} and parts/{answers[1][0].name} both answer "
                                    f"Part.{name}, which one part may answer at most; turn one of them off")
            return answers[0][1] if answers else None
        if combine is Combine.CHAIN:
            value, *context = arguments
            for function in hooks:
                value = function(value, *context)
            return value
        answers = [function(*arguments) for function in hooks]
        if combine is Combine.MERGE:
            return {key: value for answer in answers for key, value in answer.items()}
        if combine is Combine.ANSWERS:
            return [answer for answer in answers if answer is not None]
        if combine is Combine.BY_PART:
            return {part.name: answer for part, answer in zip(overriding, answers) if answer}
        return None

    every_part.__name__ = every_part.__qualname__ = name
    every_part.__doc__ = getattr(Part, name).__doc__
    return every_part


for _name, _combine in HOOKS.items():
    setattr(InstalledParts, _name, _combined(_name, _combine))


@functools.cache
def installed_parts() -> tuple[Part, ...]:
    """Every part under parts/ (none when the folder is gone), in name order, each after the parts it names in
    `after` (those installed)."""
    try:
        package = importlib.import_module("parts")
    except ModuleNotFoundError:
        return ()
    found = {module.name: importlib.import_module(f"parts.{module.name}").PART
             for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda module: module.name)}
    ordered: list[Part] = []

    def place(part: Part, placing: tuple[str, ...] = ()) -> None:
        if part in ordered:
            return
        if part.name in placing:
            raise TypeError(f"parts order themselves in a circle: {' -> '.join([*placing, part.name])}")
        for name in part.after:
            if name in found:
                place(found[name], (*placing, part.name))
        ordered.append(part)

    for part in found.values():
        if missing := [name for name in part.needs if name not in found]:
            raise TypeError(f"parts/{part.name} builds on parts/{missing[0]}, which is missing: restore it, or delete "
                            f"parts/{part.name} too")
        place(part)
    return tuple(ordered)


@functools.cache
def parts() -> InstalledParts:
    """The installed parts as one `Part`, whose hooks the core calls."""
    return InstalledParts(installed_parts())


def installed(name: str) -> bool:
    """Whether the part `name` is in this project (a fork may have left it out: scripts/new_project.py)."""
    return any(part.name == name for part in installed_parts())


def part_flags() -> dict[str, type]:
    """Each installed part's flag dataclass, by part name (training/flags.py makes train.py's flags of them)."""
    return {part.name: part.flags for part in installed_parts() if part.flags is not None}


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


