"""Owns what a pipeline layout is and which ones can run: the flags, the stage count, the launch it needs.

`--pipeline_parallel_size` stages (two per process with Interleaved1F1B), `--pipeline_schedule`,
`--pipeline_microbatches`; checked before any process group (flags) and against the launch
(strategy, process count). parts/pipeline/schedule.py runs the stages.
"""

from __future__ import annotations

from torch import nn

from parts.pipeline.flags import WHOLE_MODELS_ONLY, pipelined
from parts.pipeline.stages import split_into_stages
from training.errors import ArgumentError, StrategyError
from training.parts import Flags, parts
from training.strategy import Strategy

SCHEDULES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B"}
STAGES_PER_PROCESS = {"Interleaved1F1B": 2}  # virtual stages: a process computes two non-neighbouring stages


def stage_count(args) -> int:
    """Stages the model is cut into (1 without a pipeline)."""
    return args.parts.pipeline.pipeline_parallel_size * STAGES_PER_PROCESS.get(args.parts.pipeline.pipeline_schedule, 1) if pipelined(args) else 1


def check_pipeline_flags(model_args, data_args, args) -> None:
    """Flag combinations a pipeline cannot run, refused before any process group (ArgumentError)."""
    for name in ("pipeline_parallel_size", "pipeline_microbatches"):
        if getattr(args.parts.pipeline, name) < 1:
            raise ArgumentError(f"--{name} must be at least 1, got {getattr(args.parts.pipeline, name)}")
    if not pipelined(args):
        return
    size, micro = args.parts.pipeline.pipeline_parallel_size, args.parts.pipeline.pipeline_microbatches
    if args.per_device_train_batch_size % micro:  # (evaluation batches take the training batch's shape)
        raise ArgumentError(f"--per_device_train_batch_size {args.per_device_train_batch_size} is cut into "
                            f"--pipeline_microbatches {micro} equal micro-batches: make it a multiple of that")
    if args.parts.pipeline.pipeline_schedule != "GPipe" and micro < size:
        raise ArgumentError(f"--pipeline_schedule {args.parts.pipeline.pipeline_schedule} needs at least one micro-batch per stage: "
                            f"--pipeline_microbatches {micro} < --pipeline_parallel_size {size}; raise it (more "
                            "micro-batches also shrink the idle bubble) or use GPipe")
    if args.parts.pipeline.pipeline_schedule == "Interleaved1F1B" and micro % size:
        raise ArgumentError(f"Interleaved1F1B runs micro-batches in rounds of --pipeline_parallel_size {size}: make "
                            f"--pipeline_microbatches ({micro}) a multiple of it")
    unsupported = {"--task sft": model_args.task == "sft", "--packing false": not data_args.packing,
                   "--gradient_checkpointing": model_args.gradient_checkpointing}  # (other parts': `Pipeline.conflicts`)
    found = [split for split in parts().model_split(Flags(model_args, data_args, args)) if split != "--pipeline_parallel_size"]
    if found := found + [flag for flag, used in unsupported.items() if used]:
        raise ArgumentError(f"{', '.join(found)} with --pipeline_parallel_size is not supported{WHOLE_MODELS_ONLY}")


def check_pipeline_launch(args, strategy: Strategy, world_size: int) -> None:
    """The launch fits the pipeline: a DDP-style config whose process count is a multiple of the stages."""
    if not pipelined(args):
        return
    if strategy is not Strategy.DDP:
        raise StrategyError(f"--pipeline_parallel_size runs under accelerate_configs/ddp.yaml (replicas average "
                            f"gradients as DDP does), not {strategy.value}: FSDP and ZeRO with pipeline stages are "
                            "not supported; launch with ddp.yaml")
    if world_size % args.parts.pipeline.pipeline_parallel_size:
        raise StrategyError(f"{world_size} processes cannot hold whole pipelines of --pipeline_parallel_size "
                            f"{args.parts.pipeline.pipeline_parallel_size}; launch a multiple of it (--num_processes)")


def parameters_per_process(model: nn.Module, args) -> int:
    """The most parameters one process holds when `model` is cut into this run's stages (for the dry run's plan)."""
    stages = split_into_stages(model, stage_count(args))
    size = args.parts.pipeline.pipeline_parallel_size
    return max(sum(p.numel() for stage in stages[rank::size] for p in stage.parameters()) for rank in range(size))
