"""`--auto_find_batch_size`: the largest per-device micro-batch that fits, found before the first step.

A micro-step of the requested size runs first, on the first examples of the training set. Under DDP
nothing inside it talks to the other ranks (no all-reduce: `throwaway_micro_step`); FSDP2 and DeepSpeed
gather and reduce as always, so there the ranks must fail alike, as they do on the same shapes and memory.
DeepSpeed's engine keeps what a probe reduced (and ZeRO-3 what it gathered) in state of its own, and is
built for one micro-batch: after every probe it is destroyed and built again, for the next size or for
training, with the DeepSpeed config's batch set to match (as transformers' Trainer rebuilds it).
Then every rank says whether it ran out of memory, in one collective: if any did, all halve the
micro-batch and double the accumulation (an odd micro-batch: its largest divisor, the accumulation
multiplied to match), so that the global batch, and with it every step's loss, stays what it was, and
try again. Nothing of the probes is kept (gradients, RNG draws, BatchNorm statistics): training then
starts exactly as a launch with the found size would (tests/test_batch_size.py). A resumed run takes
the size its checkpoint recorded (`TrainerState`) instead of searching again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import send_to_device
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size
from torch.utils.data import DataLoader

from training.checkpoints.files import TRAINER_STATE
from training.collectives import max_over_ranks
from training.errors import StrategyError
from training.parts import Prepared
from training.step import forward_backward as data_parallel_forward_backward
from training.strategy import Strategy, wrapped_strategy

logger = get_logger(__name__)


def micro_step_fits(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    micro_step: Callable[[dict], object], batch: dict) -> bool:
    """Whether one forward and backward of `batch` fits in this rank's memory; nothing of it is kept: not its
    gradients, not what it drew from the RNG (dropout), not what it did to buffers (BatchNorm's statistics)."""
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    buffers = [buffer.detach().clone() for buffer in model.buffers()]
    try:
        with throwaway_micro_step(accelerator, model):
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


Probe = tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[dict], object]]  # model, optimizer, micro-step


def find_micro_batch(accelerator: Accelerator, prepared: Callable[[], Probe], examples: Callable[[int], dict],
                     per_device: int, accumulation: int, rebuild: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """The first (per-device micro-batch, accumulation) from the requested pair, halving and doubling, that
    fits on every rank. `prepared()`: the model, its optimizer and a micro-step's forward and backward
    (`micro_step(batch)`); `examples(n)`: a collated batch of the first n training examples. `rebuild(per_device,
    accumulation)`, where the prepared model keeps state from a probe (DeepSpeed): prepare the model again for
    that size; called after every probe, for the next probe or for training."""
    while True:
        model, optimizer, micro_step = prepared()
        batch = send_to_device(examples(per_device), accelerator.device)
        fits = micro_step_fits(accelerator, model, optimizer, micro_step, batch)
        del model, optimizer, micro_step, batch  # a rebuild must find the engine referenced nowhere else
        if max_over_ranks({"out_of_memory": int(not fits)}, accelerator)["out_of_memory"] == 0:
            if rebuild:
                rebuild(per_device, accumulation)
            return per_device, accumulation
        if per_device == 1:
            raise StrategyError(
                "--auto_find_batch_size: a micro-batch of 1 runs out of memory on this machine; shorten the sequences "
                "(--block_size/--max_length), use a config that shards more (scripts/plan_memory.py compares them), "
                "or add --gradient_checkpointing true"
            )
        smaller = max(size for size in range(1, per_device) if per_device % size == 0)  # half, when even
        per_device, accumulation = smaller, accumulation * (per_device // smaller)
        if rebuild:
            rebuild(per_device, accumulation)


def fit_micro_batch(accelerator: Accelerator, task, objective: Callable, train_set, args,
                    prepare_training: Callable[[torch.nn.Module], Prepared], loader_for: Callable[[int], DataLoader],
                    prepared: Prepared) -> Prepared:
    """`args`' micro-batch and accumulation set to the size that fits, and `prepared` (training/setup.py
    `prepared_for_training`) made for it: the training loader rebuilt where the first one was among accelerate's
    loaders (a checkpoint saves each loader's position by that order), or, under DeepSpeed, everything prepared again
    around a new engine after each probe."""
    requested = args.per_device_train_batch_size
    current = prepared

    def probe() -> Probe:
        model = current.model
        return model, current.optimizer, lambda batch: data_parallel_forward_backward(
            accelerator, objective, model, 1, batch, task.count_targets(batch))

    def rebuild(per_device: int, accumulation: int) -> None:
        nonlocal current
        module = release_engine(accelerator, current.model)
        args.per_device_train_batch_size, args.gradient_accumulation_steps = per_device, accumulation
        accelerator.gradient_accumulation_steps = accumulation
        resize_deepspeed_batch(accelerator, per_device, accumulation)
        current = prepare_training(module)

    args.per_device_train_batch_size, args.gradient_accumulation_steps = find_micro_batch(
        accelerator, probe, lambda n: task.collator([train_set[i] for i in range(n)]), requested,
        args.gradient_accumulation_steps, None if engine_outlives_probes(current.model) else rebuild)
    if accelerator.device.type == "cuda":  # the summary's peak is training's, not a probe's (a CPU's RSS peak stays)
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    logger.info(f"--auto_find_batch_size: a micro-batch of {args.per_device_train_batch_size} per process fits, "
                f"{args.gradient_accumulation_steps} accumulated per step"
                + (f" ({requested} ran out of memory)" if args.per_device_train_batch_size != requested else ""),
                main_process_only=True)
    if args.per_device_train_batch_size == requested or not engine_outlives_probes(current.model):
        return current
    accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps
    train_loader = current.train_loader
    current = replace(current, train_loader=accelerator.prepare_data_loader(loader_for(args.per_device_train_batch_size)))
    loaders = accelerator._dataloaders  # noqa: SLF001 - prepare_data_loader appended the new one last
    loaders[loaders.index(train_loader)] = loaders.pop()
    return current


def take_recorded_micro_batch(accelerator: Accelerator, args, checkpoint: Path) -> None:
    """Resuming: the (micro-batch, accumulation) the checkpoint's run found, when it recorded one for this global
    batch (another global batch: `load_checkpoint` refuses it)."""
    recorded = recorded_micro_batch(checkpoint)
    if recorded and recorded[0] * recorded[1] == args.per_device_train_batch_size * args.gradient_accumulation_steps:
        args.per_device_train_batch_size, args.gradient_accumulation_steps = recorded
        accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps


# ---- where strategies differ for the search (this part's own: the core's are in training/strategy/adapters.py)


@contextmanager
def throwaway_micro_step(accelerator: Accelerator, model: torch.nn.Module) -> Iterator[None]:
    """Around a micro-step whose gradients are then dropped (--auto_find_batch_size's probe).
    DDP skips its all-reduce, so nothing in the step waits for another rank. FSDP2 reduces as always: skipping
    would leave the gradients in its own unsharded buffers, out of `zero_grad`'s reach, and they would join the
    first real step's (measured: a 0.05 loss difference at step 2). DeepSpeed's engine runs its backward off the
    accumulation boundary, so it does not step; what it reduced stays in its own buffers, which is why its
    engine is built again after every probe (`engine_outlives_probes`)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
        return
    sync = accelerator.sync_gradients
    accelerator.sync_gradients = wrapped_strategy(model) is not Strategy.DEEPSPEED and sync
    try:
        yield
    finally:
        accelerator.sync_gradients = sync


def engine_outlives_probes(model: torch.nn.Module) -> bool:
    """Whether the prepared model can train after --auto_find_batch_size's probes as it is: not a DeepSpeed engine,
    whose ZeRO-2/3 keep a probe's reduced gradients (and ZeRO-3 its gathered weights) in the engine's own state."""
    return wrapped_strategy(model) is not Strategy.DEEPSPEED


def release_engine(accelerator: Accelerator, engine: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DeepSpeed engine, the engine destroyed (its hooks removed) and accelerate's references
    to everything prepared dropped (`free_memory`), so that `prepare` builds a new engine around it. Under ZeRO-3 a
    probe that ran out of memory may have left weights gathered: they are partitioned again first."""
    engine.empty_partition_cache()  # ZeRO-3: every weight back to its partition (other stages: nothing to do)
    module = engine.module
    accelerator.free_memory()
    return module


def resize_deepspeed_batch(accelerator: Accelerator, per_device: int, accumulation: int) -> None:
    """Set the DeepSpeed config's batch to `per_device` x `accumulation` (x processes), before `prepare` builds an
    engine from it."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = per_device
    config["gradient_accumulation_steps"] = accumulation
    config["train_batch_size"] = per_device * accumulation * accelerator.num_processes


def recorded_micro_batch(path: Path) -> tuple[int, int] | None:
    """The (micro-batch, accumulation) a checkpoint's run trained with, if it recorded them."""
    saved = json.loads((path / TRAINER_STATE).read_text())
    pair = (saved.get("per_device_train_batch_size", 0), saved.get("gradient_accumulation_steps", 0))
    return pair if all(pair) else None
