"""`train.py --dry_run`: what a run checks and decides before its first step, without training.

Launch it exactly as the run (`accelerate launch --config_file ... train.py ... --dry_run`):
rank 0 alone does the work, in one process, and the other processes exit at once. It
reads the launcher's settings from the environment `accelerate launch` sets, so it starts
no process group and needs no GPU (plan an 8-GPU job on a login node with
`--num_processes 8`; what only a GPU can run, such as fp16, is then a note). It checks the
flags (already parsed), the launcher config and its DeepSpeed JSON, loads and tokenizes the
data, builds the model as rank 0 of the run does, in CPU memory (a pretrained 7B model
needs about 28 GB), and prints the plan:
strategy, global batch, steps, and the memory per rank that `training/memory_plan.py`
computes for this layout. Any problem is the error line (exit 2) the real run would give.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

from accelerate.utils import DeepSpeedPlugin, set_seed

from training.strategy import Strategy, check_launch_config, has_accelerator_device, requested_strategy
from training.strategy_adapters import align_deepspeed_config
from training.errors import StrategyError
from training.memory_plan import (
    Layout,
    activation_bytes,
    deepspeed_layout,
    fsdp_layout,
    model_shape,
    model_state,
    working_bytes,
)
from training.optim import global_batch_size, optimizer_for, run_length, warmup_steps
import math

from training.parts import each, found, through
from training.performance import compute_dtype, parameter_count
from training.task_registry import build_task

MIB = 2**20


def launched_layout(strategy: Strategy, args) -> Layout:
    """How the launched config lays out model state, read from `accelerate launch`'s environment.

    DeepSpeed's config is resolved and aligned with the flags as training does it, so a JSON
    value that disagrees with a flag is refused here too."""
    if strategy is Strategy.DEEPSPEED:
        config = DeepSpeedPlugin().deepspeed_config
        align_deepspeed_config(config, args.max_grad_norm, args.per_device_train_batch_size)
        return deepspeed_layout("launched", config)
    if strategy is Strategy.FSDP:
        tp_size = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1"))
        offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
        return fsdp_layout("launched", offload, tp_size)
    return Layout("launched", strategy.value)


def dry_run(model_args, data_args, args) -> str | None:
    """The plan of this launch, as lines to print; None on every rank but 0."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    strategy, processes = requested_strategy(), int(os.environ.get("WORLD_SIZE", "1"))
    # Planned on a login node for GPU machines: check as on a GPU, and say what this machine would refuse.
    check_launch_config(strategy, on_cpu=False)
    each("check_launch", args, strategy, processes, False)  # the parts' (training/parts.py)
    cpu_note = ""
    if not has_accelerator_device():
        try:
            check_launch_config(strategy, on_cpu=True)
            each("check_launch", args, strategy, processes, True)
        except StrategyError as error:
            cpu_note = f"\nnote:            no GPU here; on CPU machines the run would stop: {error}"
    layout = launched_layout(strategy, args)
    mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    set_seed(args.seed)

    task = build_task(model_args, data_args)
    raw = task.load_raw_datasets(args.seed)
    model = through("adapt_model", task.build_model(raw), model_args, args)  # the parts' (an adapter), as set-up does
    train_set, eval_set = task.datasets(raw, nullcontext())
    data_parallel = processes // math.prod(each("processes_per_replica", args))  # a tp group, a pipeline read one batch
    global_batch = global_batch_size(args, data_parallel)
    steps_per_epoch, max_steps = run_length(len(train_set), len(eval_set), global_batch, args)

    offloaded = layout.deepspeed and layout.offload_optimizer  # ZeRO steps the optimizer on the CPU
    dtype = compute_dtype(mixed_precision)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    held = next(iter(found("held_parameters", model, args)), None) or parameter_count(model)  # the most on one process (a part may cut the model)
    state = model_state(layout, held, processes, dtype.itemsize, trainable * held // parameter_count(model))
    memory = (f"model state {(state['parameters'] + state['gradients'] + state['optimizer']) / MIB:,.1f} MiB "
              f"(parameters {state['parameters'] / MIB:,.1f}, gradients {state['gradients'] / MIB:,.1f}, "
              f"optimizer {state['optimizer'] / MIB:,.1f}; {state['offloaded'] / MIB:,.1f} of it in CPU memory)")
    if hasattr(task, "block_size"):  # the activation estimate traces a causal LM (training/memory_plan.py)
        shape = model_shape(model.config, dtype, model_args.trust_remote_code)
        activations = activation_bytes(shape, args.per_device_train_batch_size, task.block_size,
                                       model_args.gradient_checkpointing)
        memory += (f", activations ~{activations / MIB:,.1f} MiB and working buffers "
                   f"~{working_bytes(layout, shape, dtype.itemsize) / MIB:,.1f} MiB (estimates)")
    memory += "".join(f"\n{line}" for lines in each("dry_run_lines", task, args, strategy, processes, dtype.itemsize) for line in lines)
    return (
        "\n===== dry run: checked, nothing trained =====\n"
        f"launch:          {layout.strategy}, {processes} process(es), {data_parallel} data-parallel, "
        f"mixed precision {mixed_precision}\n"
        f"model:           {model_args.model_name_or_path or model_args.model_config}, "
        f"{parameter_count(model):,} parameters ({type(model).__name__}), {trainable:,} trained\n"
        f"data:            {task.describe_data(train_set)}, {len(eval_set)} examples for evaluation\n"
        f"global batch:    {global_batch} = {args.per_device_train_batch_size} per device x {data_parallel} "
        f"data-parallel x {args.gradient_accumulation_steps} accumulation\n"
        f"steps:           {max_steps} ({steps_per_epoch} per epoch), warmup {warmup_steps(args, max_steps)}, "
        f"{args.lr_scheduler_type}, --optim {args.optim} ({optimizer_for(args.optim, offloaded).class_name})\n"
        f"memory/rank:     {memory}{cpu_note}"
    )
