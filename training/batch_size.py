"""`--auto_find_batch_size`: the largest per-device micro-batch that fits, found before the first step.

A micro-step of the requested size runs first, on the first examples of the training set. Under DDP
nothing inside it talks to the other ranks (no all-reduce: `throwaway_micro_step`); FSDP2 gathers and
reduces as always, so there the ranks must fail alike, as they do on the same shapes and memory.
Then every rank says whether it ran out of memory, in one collective: if any did, all halve the
micro-batch and double the accumulation (an odd micro-batch: its largest divisor, the accumulation
multiplied to match), so that the global batch, and with it every step's loss, stays what it was, and
try again. Nothing of the probes is kept (gradients, RNG draws, BatchNorm statistics): training then
starts exactly as a launch with the found size would (tests/test_batch_size.py). A resumed run takes
the size its checkpoint recorded (`TrainerState`) instead of searching again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

from training.checkpoint import recorded_micro_batch
from training.collectives import max_over_ranks
from training.errors import ArgumentError, StrategyError
from training.flags import TrainArguments
from training.strategy import Strategy
from training.strategy_adapters import throwaway_micro_step


def check_auto_find_batch_size(train_args: TrainArguments, strategy: Strategy, split: str | None) -> None:
    """The search resizes the micro-batch of data-parallel training; `split`: what else cuts the model, if anything
    (pipeline stages, --device_map, tensor parallelism)."""
    if not train_args.auto_find_batch_size:
        return
    if strategy is Strategy.DEEPSPEED:
        raise ArgumentError(
            "--auto_find_batch_size is not supported under DeepSpeed yet (its engine is built for one micro-batch); "
            "pick --per_device_train_batch_size with `python scripts/plan_memory.py` (it prints the micro-batch that "
            "fits each config), or use accelerate_configs/fsdp.yaml"
        )
    if split:
        raise ArgumentError(f"--auto_find_batch_size with {split} is not supported; set --per_device_train_batch_size "
                            "yourself")


def micro_step_fits(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_step: Callable[[dict], object],
                    batch: dict) -> bool:
    """Whether one forward and backward of `batch` fits in this rank's memory; nothing of it is kept: not its
    gradients, not what it drew from the RNG (dropout), not what it did to buffers (BatchNorm's statistics)."""
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    buffers = [buffer.detach().clone() for buffer in model.buffers()]
    try:
        with throwaway_micro_step(model):
            micro_step(batch)
        return True
    except RuntimeError as error:  # accelerate's test: CUDA, XPU, MPS and the CPU allocator's messages
        if not should_reduce_batch_size(error):
            raise
        return False
    finally:
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        clear_device_cache(garbage_collection=True)


def find_micro_batch(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     micro_step: Callable[[dict], object], examples: Callable[[int], dict],
                     per_device: int, accumulation: int) -> tuple[int, int]:
    """The first (per-device micro-batch, accumulation) from the requested pair, halving and doubling, that
    fits on every rank. `micro_step(batch)`: a micro-step's forward and backward; `examples(n)`: a
    collated batch of the first n training examples."""
    while True:
        batch = send_to_device(examples(per_device), accelerator.device)
        fits = micro_step_fits(model, optimizer, micro_step, batch)
        del batch
        if max_over_ranks({"out_of_memory": int(not fits)}, accelerator)["out_of_memory"] == 0:
            return per_device, accumulation
        if per_device == 1:
            raise StrategyError(
                "--auto_find_batch_size: a micro-batch of 1 runs out of memory on this machine; shorten the sequences "
                "(--block_size/--max_length), use a config that shards more (scripts/plan_memory.py compares them), "
                "or add --gradient_checkpointing true"
            )
        smaller = max(size for size in range(1, per_device) if per_device % size == 0)  # half, when even
        per_device, accumulation = smaller, accumulation * (per_device // smaller)


def take_recorded_micro_batch(accelerator: Accelerator, args: TrainArguments, checkpoint: Path) -> None:
    """Resuming: the (micro-batch, accumulation) the checkpoint's run found, when it recorded one for this global
    batch (another global batch: `load_checkpoint` refuses it)."""
    recorded = recorded_micro_batch(checkpoint)
    if recorded and recorded[0] * recorded[1] == args.per_device_train_batch_size * args.gradient_accumulation_steps:
        args.per_device_train_batch_size, args.gradient_accumulation_steps = recorded
        accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps
