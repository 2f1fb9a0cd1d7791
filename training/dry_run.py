"""`train.py --dry_run`: checks a launch and plans it without training. Launched exactly as the run, rank 0 alone works,
from the environment `accelerate launch` sets: no process group or GPU (plan 8 GPUs on a login node). It builds the
model in CPU memory (a pretrained 7B needs about 28 GB); any problem is the run's own error line (exit 2)."""

from __future__ import annotations

import dataclasses
import os
from contextlib import nullcontext

import torch
from accelerate.utils import DeepSpeedPlugin, set_seed

from training.strategy.accelerator import check_launch
from training.errors import StrategyError
from training.optim import global_batch_size, optimizer_for, run_length, warmup_steps
from training.parts import Flags, Launch, Plan, parts
from training.performance import compute_dtype, parameter_count
from training.setup import data_parallel
from training.strategy import Strategy, requested_strategy
from training.strategy.adapters import align_deepspeed_config
from training.task_registry import build_task


def launched(strategy: Strategy, args) -> tuple[str, bool]:
    """The strategy as launched, and whether ZeRO steps the optimizer on the CPU; DeepSpeed's config is aligned with the
    flags as in training, so a JSON value that disagrees with a flag is refused here too."""
    if strategy is not Strategy.DEEPSPEED:
        return strategy.value, False
    config = DeepSpeedPlugin().deepspeed_config
    align_deepspeed_config(config, args.max_grad_norm, args.per_device_train_batch_size)
    zero = config.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {}).get("device", "none")
    return f"deepspeed ZeRO-{zero.get('stage', 0)}" + (f" offload={offload}" if offload != "none" else ""), offload != "none"


def dry_run(model_args, data_args, args) -> str | None:
    """The plan of this launch, as lines to print; None on every rank but 0."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    strategy, processes = requested_strategy(), int(os.environ.get("WORLD_SIZE", "1"))
    # Planned on a login node for GPU machines: check as on a GPU, and say what this machine would refuse.
    check_launch(Launch(args, strategy, processes, on_cpu=False))  # the core's and the parts', as a real launch checks
    cpu_note = ""
    if not torch.accelerator.is_available():
        try:
            check_launch(Launch(args, strategy, processes, on_cpu=True))
        except StrategyError as error:
            cpu_note = f"\nnote:            no GPU here; on CPU machines the run would stop: {error}"
    launch, offloaded = launched(strategy, args)
    mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    set_seed(args.seed)

    task = build_task(model_args, data_args)
    raw = task.load_raw_datasets(args.seed)
    model = parts().adapt_model(task.build_model(raw), Flags(model_args, data_args, args))  # as set-up does
    train_set, eval_set = task.datasets(raw, nullcontext())
    _, replicas = data_parallel(processes, args)
    global_batch = global_batch_size(args, replicas)
    steps_per_epoch, max_steps = run_length(len(train_set), len(eval_set), global_batch, args)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plan = Plan(task, model, model_args, args, strategy, processes, compute_dtype(mixed_precision))
    held = next(iter(parts().held_parameters(plan)), None) or parameter_count(model)  # a part may cut the model
    part_lines = parts().dry_run_line(dataclasses.replace(plan, held_parameters=held))
    return (
        "\n===== dry run: checked, nothing trained =====\n"
        f"launch:          {launch}, {processes} process(es), {replicas} data-parallel, "
        f"mixed precision {mixed_precision}\n"
        f"model:           {task.model_name or type(model).__name__}, "
        f"{parameter_count(model):,} parameters ({type(model).__name__}), {trainable:,} trained"
        + (f", at most {held:,} on one process" if held != parameter_count(model) else "") + "\n"
        f"shape:           {task.describe_model(model)}\n"
        f"data:            {task.describe_data(train_set)}, {len(eval_set)} examples for evaluation\n"
        f"global batch:    {global_batch} = {args.per_device_train_batch_size} per device x {replicas} "
        f"data-parallel x {args.gradient_accumulation_steps} accumulation\n"
        f"steps:           {max_steps} ({steps_per_epoch} per epoch), warmup {warmup_steps(args, max_steps)}, "
        f"{args.lr_scheduler_type}, --optim {args.optim} ({optimizer_for(args.optim, offloaded).class_name})"
        + "".join(f"\n{line}" for line in part_lines) + cpu_note
    )
