"""Owns the set-up phase of train.py, from parsed flags to a `Run`: the Accelerator checked to run the configured
strategy, the model built and laid out, the data loaders, `prepare`, a resumed state, the trackers."""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    broadcast_object_list,
    set_seed,
)
from torch.utils.data import DataLoader, Dataset, Subset

from training.checkpoints.changes import recorded_flags
from training.checkpoints.files import TrainerState, clear_previous_run
from training.checkpoints.resume import model_description, resolve_resume_path, resume, tracker_purge_step
from training.console import one_voice
from training.errors import ModelError
from training.flags import DataArguments, ModelArguments, TrainArguments, every_flag
from training.optim import build_optimizer, build_scheduler, global_batch_size, run_length
from training.parts import Flags, Loading, MicroBatchSearch, Prepared, Started, Training, parts
from training.performance import SpeedMeter, parameter_count
from training.runner import ModelRunner
from training.step import training_objective
from training.strategy import Strategy, master_weight_dtypes, verify_prepared, verify_strategy
from training.strategy.accelerator import build_accelerator, describe, model_construction
from training.strategy.adapters import (
    align_with_strategy,
    config_name,
    gradient_reduction_dtypes,
    optimizer_offload_device,
    write_effective_deepspeed_config,
)
from training.task_registry import build_task
from training.tasks import Task

logger = get_logger(__name__)


@dataclass
class Run:
    """What set-up builds and the training and finishing phases share."""

    args: TrainArguments
    accelerator: Accelerator
    strategy: Strategy
    task: Task
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: DataLoader | Iterable[dict]  # a part's loader keeps its own position (a stream's)
    eval_loader: DataLoader
    state: TrainerState  # the step, epoch and position within it: what a checkpoint resumes
    steps_per_epoch: int
    max_steps: int
    model_name: str
    title: str  # "<model>: <strategy, processes, precision>", for the report
    num_parameters: int
    speed: SpeedMeter
    first_step: int  # the step this launch started from (0, or the resumed checkpoint's: never 0)
    model_args: ModelArguments
    runner: ModelRunner  # how the model trains, evaluates, saves and exports (training/runner.py)
    objective: Callable[[torch.nn.Module, dict], torch.Tensor]  # a micro-batch's loss sums (training/step.py)
    ranks_per_batch: int  # ranks that read the same batches (a tensor-parallel group): counted once
    torch_optimizer: torch.optim.Optimizer  # the torch optimizer inside `optimizer` (the parts' hooks get it)


def set_up(model_args: ModelArguments, data_args: DataArguments, args: TrainArguments) -> Run:
    """The Accelerator, then the model and data, then `prepare`, then a resumed state and the trackers."""
    accelerator, strategy, run_description = start_accelerator(args)
    resume_path = resolve_resume_path(args.resume_from_checkpoint, args.output_dir, accelerator)
    started, flags = Started(accelerator, args, resume_path), Flags(model_args, data_args, args)
    if resume_path:
        parts().resuming(started)  # settings the checkpoint recorded
    set_seed(args.seed)  # identical initial weights on every rank and strategy

    task = build_task(model_args, data_args)
    with accelerator.main_process_first():  # the main process downloads; the others then read its cache
        raw = task.load_raw_datasets(args.seed)
    model = build_model(started, flags, task, raw)
    described = model_description(task, model)  # what checkpoints record of the model, and a resume checks
    model_name = task.model_name or type(model).__name__  # a pretrained model or named config, else the class
    check_rebuildable(task)
    num_parameters = parameter_count(model)
    logger.info(f"model {model_name}: {task.describe_model(model)}; {num_parameters:,} parameters", main_process_only=True)
    # a part may lay the model out (layers over GPUs, tp slices, pipeline stages), and run it its own way (stages)
    model = parts().wrap_model(model, started)
    runner = parts().model_runner(model, started) or ModelRunner(accelerator)
    # several devices: a part split the layers over this process's GPUs
    devices = sorted({p.device for p in model.parameters() if p.device.type == accelerator.device.type}, key=str)
    train_set, eval_set = task.datasets(raw, accelerator.main_process_first())
    ranks_per_batch, replicas = data_parallel(accelerator.num_processes, args)
    global_batch = global_batch_size(args, replicas)
    # Pinned host memory lets batches copy to the GPU while it computes (non_blocking in start_accelerator).
    loading = {"collate_fn": task.collator, "num_workers": args.dataloader_num_workers or 0,
               "pin_memory": args.dataloader_pin_memory and accelerator.device.type == "cuda",
               **parts().loader_settings(args)}  # the parts' (workers on GPUs, workers that ignore stop signals)
    # a part may batch the training set itself (a stream's share: no length, so no epoch length either, 0)
    if (part_loader := parts().train_loader(Loading(accelerator, args, task, train_set, loading))) is not None:
        train_data = part_loader
        steps_per_epoch, max_steps = 0, args.max_steps
    else:
        steps_per_epoch, max_steps = run_length(len(train_set), len(eval_set), global_batch, args)
        # whole global batches only; Subset, not datasets' select: any map-style Dataset trains
        train_data = train_set = Subset(train_set, range(steps_per_epoch * global_batch))
    prepare_training = partial(prepared_for_training, accelerator, runner, task, train_data, eval_set, args, loading,
                               max_steps)
    prepared = prepare_training(model)
    # loss sums of a micro-batch; a part may compute them another way, compile them with the model, or replace them
    objective = training_objective(Training(accelerator, args, task, strategy, prepared.model, max_steps=max_steps))
    # a part may prepare again for another micro-batch (the search for one that fits)
    prepared = parts().micro_batch(prepared, MicroBatchSearch(
        accelerator, args, task, objective, train_set, prepare_training,
        partial(training_loader, train_set, seed=args.seed, **loading), bool(resume_path)))
    model, optimizer, scheduler, torch_optimizer = (prepared.model, prepared.optimizer, prepared.scheduler,
                                                    prepared.torch_optimizer)
    training = Training(accelerator, args, task, strategy, model, torch_optimizer, ranks_per_batch, max_steps)
    parts().after_prepare(training)
    verify_prepared(accelerator, model, optimizer, scheduler, args.per_device_train_batch_size, args.max_grad_norm)
    write_effective_deepspeed_config(accelerator, args.output_dir)
    logger.info(
        f"model wrapped as {type(model).__name__}; optimizer {type(torch_optimizer).__name__} (--optim {args.optim}), "
        f"master weights {', '.join(str(d) for d in master_weight_dtypes(model, optimizer))}, "
        f"gradients averaged in {', '.join(str(d) for d in gradient_reduction_dtypes(model))}",
        main_process_only=True,
    )

    layout = parts().checkpoint_layout(args)  # how the parts cut the model: recorded, and a resume must match it
    launched = config_name(accelerator, strategy)
    state = TrainerState(global_batch=global_batch, num_processes=accelerator.num_processes, strategy=launched,
                         layout=layout, optim=args.optim, run_id=broadcast_object_list([uuid.uuid4().hex])[0],
                         model=described, flags=recorded_flags(every_flag(model_args, data_args, args)),
                         optimizer_groups=len(torch_optimizer.param_groups))  # (one run id on every rank)
    if resume_path:
        state = resume(accelerator, resume_path, state, max_steps, args.seed, runner, model, optimizer, scheduler,
                       args.output_dir, args.allow_config_changes, args.resume_unchecked, evaluating=not args.do_train)
    state.per_device_train_batch_size, state.gradient_accumulation_steps = (args.per_device_train_batch_size,
                                                                            args.gradient_accumulation_steps)
    if args.overwrite_output_dir:  # only now: every check before has passed
        if accelerator.is_main_process:
            clear_previous_run(args.output_dir)
        accelerator.wait_for_everyone()
    run_settings = {"strategy": strategy.value, "num_processes": accelerator.num_processes,
                    "mixed_precision": accelerator.mixed_precision, "global_batch": global_batch,
                    "total_steps": max_steps, "parameters": num_parameters, **task.settings}
    settings = every_flag(model_args, data_args, args) | run_settings
    accelerator.init_trackers(
        args.run_name,  # trackers take scalars and strings only: None and lists as text
        config={key: value if isinstance(value, (bool, int, float, str)) else str(value) for key, value in settings.items()},
        # A resumed run replaces what the run it continues logged after its checkpoint.
        init_kwargs={"tensorboard": {"purge_step": tracker_purge_step(state, bool(resume_path))},
                     "wandb": {"name": args.run_name}},
    )
    logger.info(
        f"{task.describe_data(train_set)}, global batch {global_batch}, "
        f"{f'{steps_per_epoch} steps/epoch' if steps_per_epoch else 'epochs as long as the stream'}, "
        f"{f'training to step {max_steps}' if args.do_train else 'evaluating only (--do_train false)'}, "
        f"{len(eval_set)} examples for evaluation",
        main_process_only=True,
    )
    speed = SpeedMeter(accelerator.device, task.unit, ranks_per_batch,  # ranks that read each batch
                       memory_devices=devices if len(devices) > 1 else None,
                       figures=parts().logged_figures(training))  # the parts' (MFU, DPO's rewards)
    return Run(args, accelerator, strategy, task, model, optimizer, scheduler, prepared.train_loader,
               prepared.eval_loader, state,
               steps_per_epoch, max_steps, model_name,
               f"{model_name}: {run_description}", num_parameters, speed, state.completed_steps, model_args,
               runner, objective, ranks_per_batch, torch_optimizer)


def check_rebuildable(task: Task) -> None:
    """A plain nn.Module's constructor arguments go into final/model.json: refused now, not after training, if they
    are not JSON."""
    try:
        json.dumps(task.model_kwargs)
    except (TypeError, ValueError) as error:
        raise ModelError(f"the task's model_kwargs cannot be written to final/model.json ({error}); give the model's "
                         "constructor plain numbers, strings, lists and dicts") from None


def data_parallel(processes: int, args: TrainArguments) -> tuple[int, int]:
    """The processes that read each batch (a tensor-parallel group, a pipeline's stages: the parts say), and the
    data-parallel replicas, which read different batches."""
    ranks_per_batch = math.prod(parts().ranks_per_batch(args))
    return ranks_per_batch, processes // ranks_per_batch


def prepared_for_training(accelerator: Accelerator, runner: ModelRunner, task: Task, train_data, eval_set,
                          args: TrainArguments, loading: dict, max_steps: int, model: torch.nn.Module) -> Prepared:
    """`model`, its optimizer, the training and evaluation loaders and the scheduler, through `prepare`, for
    the flags' micro-batch; and the torch optimizer inside the prepared one. `train_data`: the training set, or
    a part's loader (a stream's, which `prepare` passes through: each rank reads its own share)."""
    loader = training_loader(train_data, args.per_device_train_batch_size, args.seed, **loading) if isinstance(
        train_data, Dataset) else train_data
    eval_loader = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size, **loading)
    align_with_strategy(accelerator, model, args.max_grad_norm, args.per_device_train_batch_size)
    torch_optimizer = build_optimizer(model, args, offloaded=optimizer_offload_device(accelerator) != "none")
    scheduler = build_scheduler(torch_optimizer, args, max_steps)
    return Prepared(*runner.prepare(model, task, args.seed, torch_optimizer, loader, eval_loader, scheduler),
                    torch_optimizer)



def training_loader(dataset, batch_size: int, seed: int, **loading) -> DataLoader:
    """Shuffled batches (by seed and epoch, once accelerate's seedable sampler takes over), with a
    generator of its own: each epoch's iterator draws its seed from it, not from the global RNG that
    dropout uses and a checkpoint restores (a resumed run would otherwise draw different masks)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed),
                      **loading)


def start_accelerator(args: TrainArguments) -> tuple[Accelerator, Strategy, str]:
    """The Accelerator, checked to run the configured strategy; the start-up lines on the main process."""
    accelerator = build_accelerator(
        args,
        # Synchronise by step count only: train.py reads a whole window ahead (see
        # accumulation_windows), so the dataloader's end is seen before the window's last step.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        # We step the scheduler once per optimizer step ourselves: accelerate would step it
        # once per process, making the schedule depend on the number of processes.
        step_scheduler_with_optimizer=False,
        # A seedable sampler makes the shuffled order depend only on seed and epoch, so a
        # resumed run sees the same samples as an uninterrupted one.
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=args.seed, non_blocking=args.dataloader_pin_memory
        ),
        log_with=args.report_to or None,  # TensorBoard writes to output_dir/runs/<run_name>
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "runs")),
        **parts().accelerator_settings(args),  # the parts' (accelerate's dynamo plugin under --torch_compile)
    )
    strategy = verify_strategy(accelerator)
    one_voice(accelerator.is_main_process)  # the other ranks report errors only
    run_description = describe(accelerator, strategy)
    logger.info(run_description, main_process_only=True)
    for line in parts().started(Started(accelerator, args)):  # the parts' (threads on CPU, TF32 on GPUs, the ranks' map)
        logger.info(line, main_process_only=True)
    return accelerator, strategy, run_description


def build_model(started: Started, flags: Flags, task: Task, raw) -> torch.nn.Module:
    """The task's model, built without a whole copy per rank where the strategy allows, converted by the
    parts (training/parts.py: kernels, SyncBatchNorm), then adapted by the parts (an adapter)."""
    with model_construction(started.accelerator, bool(flags.model.model_name_or_path), task.can_build_empty) as empty:
        model = task.build_model(raw, empty)
    model = parts().convert_model(model, started)
    set_seed(flags.train.seed)  # ranks that built the model empty drew no random numbers: every rank goes on level
    return parts().adapt_model(model, flags)  # (an adapter): after the seed, every rank draws alike
