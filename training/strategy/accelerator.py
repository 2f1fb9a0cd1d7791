"""Owns building the Accelerator for the configured strategy, the model within it, and the run's start-up lines."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs

from training.collectives import joining_process_group, start_restarted_process_group
from training.strategy.cpu import cpu_process_group
from training.parts import Launch, parts
from training.strategy import Strategy, check_launch_config, requested_strategy
from training.strategy.adapters import optimizer_offload_device

logger = get_logger(__name__)


def build_accelerator(args, **accelerator_kwargs) -> Accelerator:
    """An `Accelerator` for the configured strategy, on GPUs or, for real, on CPU."""
    launch = Launch(args, requested_strategy(), int(os.environ.get("WORLD_SIZE", "1")), not torch.accelerator.is_available())
    parts().at_start(launch)  # (start-up work skipped: parts/fast_start), before DeepSpeed loads
    timeout = timedelta(seconds=args.ddp_timeout)
    check_launch(launch)
    # DDP: gradients live in its buckets (one copy, not two), and buffers are not copied from rank 0 before each
    # forward: BatchNorm statistics are averaged instead, on every strategy alike (training/batchnorm.py).
    ddp = DistributedDataParallelKwargs(gradient_as_bucket_view=True, broadcast_buffers=False,
                                        **parts().ddp_settings(launch))
    with joining_process_group(timeout):  # started here (a restarted round; FSDP2 on CPU) or by accelerate
        start_restarted_process_group("gloo" if launch.on_cpu else InitProcessGroupKwargs.backend, timeout)
        cpu, backend = (cpu_process_group(launch.strategy, timeout) if launch.on_cpu else
                        (False, InitProcessGroupKwargs.backend))
        handler = InitProcessGroupKwargs(backend=backend, timeout=timeout)
        return Accelerator(cpu=cpu, kwargs_handlers=[handler, ddp], **accelerator_kwargs)


def check_launch(launch: Launch) -> None:
    """The launcher's settings, checked by the core and by the parts, before any process group (and by the dry run)."""
    check_launch_config(launch.strategy, launch.on_cpu)
    parts().check_launch(launch)


def describe(accelerator: Accelerator, strategy: Strategy) -> str:
    """One line for the logs: strategy, processes, backend and device."""
    detail = ""
    if strategy is Strategy.DEEPSPEED:
        offload = optimizer_offload_device(accelerator)
        detail = f" ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}" + (f" offload={offload}" if offload != "none" else "")
    elif strategy is Strategy.FSDP:
        detail = f" v{accelerator.state.fsdp_plugin.fsdp_version}"
    backend = accelerator.state.backend or "none"
    return (
        f"strategy={strategy.value}{detail} processes={accelerator.num_processes} "
        f"backend={backend} device={accelerator.device.type} mixed_precision={accelerator.mixed_precision}")


@contextmanager
def model_construction(accelerator: Accelerator, pretrained: bool, can_build_empty: bool) -> Iterator[bool]:
    """Build the model so that no rank holds a whole fp32 copy in host memory when it need not (7B: 28 GB per rank);
    yields whether this rank builds it empty. FSDP2 with cpu_ram_efficient_loading: rank 0 builds it, `prepare`
    broadcasts. ZeRO-3: pretrained weights load partitioned; a model from scratch only under `zero3_init_flag`
    (random weights built partitioned differ from the other strategies')."""
    from transformers.integrations import unset_hf_deepspeed_config

    fsdp = accelerator.state.fsdp_plugin if accelerator.distributed_type is DistributedType.FSDP else None
    if fsdp is not None:
        fsdp.cpu_ram_efficient_loading = bool(fsdp.cpu_ram_efficient_loading) and can_build_empty
        if fsdp.cpu_ram_efficient_loading:
            logger.info("model built on rank 0 only; `prepare` broadcasts its weights (fsdp_cpu_ram_efficient_loading)")
        yield fsdp.cpu_ram_efficient_loading and accelerator.process_index != 0
        return
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero3_init_flag or (pretrained and plugin.zero_stage == 3):
        if plugin is not None and plugin.zero_stage == 3:
            logger.info("model built partitioned over the ranks (deepspeed.zero.Init)")
        yield False
        return
    unset_hf_deepspeed_config()  # accelerate 1.15 registers it even with zero3_init_flag false: every model partitioned
    try:
        yield False
    finally:
        plugin.set_deepspeed_weakref()


def release_model_construction_hooks() -> None:
    """After training, let one process alone build `transformers` models again (the summary loads the export): with
    ZeRO-3's config registered, every new model is built partitioned, a collective that needs all ranks."""
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
