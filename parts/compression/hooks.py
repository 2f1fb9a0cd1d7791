"""The hooks of parts/compression (`--ddp_comm_hook`): the hook, the bytes it sends, and PowerSGD's state in checkpoints.

accelerate's `DistributedDataParallelKwargs(comm_hook=...)` builds torch's hooks and their state;
they are registered here, after `prepare`, for what accelerate's own registration does not do:
- the hook is wrapped to count the bytes every all-reduce it issues carries (per rank: the
  payload handed to the collective, whatever algorithm the backend then runs), on a process
  group of its own so that nothing else is counted;
- PowerSGD's state (error feedback, the warm-started P and Q, its random generator, its step
  counter) lives inside the hook: each rank saves its own with every checkpoint
  (`powersgd_rank<N>.pt`) and restores it on resume, so a resumed run continues exactly. Only the error
  feedback differs per rank: on another number of processes every rank restores rank 0's state and starts
  its error feedback afresh, so that all ranks compress from the same step.
FSDP and DeepSpeed own their communication, so the flag is for the ddp config only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

from training.errors import StrategyError
from training.strategy import Strategy

logger = get_logger(__name__)

POWER_SGD_STATE = "powersgd_rank{rank}.pt"


def check_comm_hook(hook: str | None, strategy: Strategy, processes: int, on_cpu: bool) -> None:
    """Refuse a hook that cannot run here, with the fix."""
    if hook is None:
        return
    if strategy is not Strategy.DDP or processes < 2:
        where = strategy.value if strategy is not Strategy.DDP else "one process"
        raise StrategyError(f"--ddp_comm_hook compresses DDP's all-reduce between processes, and this run is {where} "
                            "(FSDP and DeepSpeed own their communication); launch with accelerate_configs/ddp.yaml on "
                            "2 or more processes, or drop the flag")
    if hook == "bf16" and on_cpu:
        raise StrategyError("--ddp_comm_hook bf16 needs CUDA (torch's bf16 hook) and this machine has none; "
                            "use fp16, power_sgd or batched_power_sgd on CPU")


@dataclass
class GradientTraffic:
    """Bytes the gradient hook hands to all-reduce on this rank, counted as it calls the collective."""

    bytes_sent: int = 0
    group: dist.ProcessGroup | None = None  # the hook's own group: only its collectives count

    def counting(self) -> None:
        """Count every `torch.distributed.all_reduce` on `group` (torch's hooks call it by module attribute,
        also from the callbacks they chain after returning)."""
        all_reduce = dist.all_reduce

        @functools.wraps(all_reduce)
        def counted(tensor, *args, group=None, **kwargs):
            if group is not None and group is self.group:
                self.bytes_sent += tensor.numel() * tensor.element_size()
            return all_reduce(tensor, *args, group=group, **kwargs)

        dist.all_reduce = counted


def register_comm_hook(model: torch.nn.Module, hook: str | None, power_sgd_rank: int,
                       power_sgd_start_step: int) -> GradientTraffic | None:
    """After `prepare`, before the first step: the --ddp_comm_hook on the DDP model, built by accelerate's
    `DistributedDataParallelKwargs` and registered on a counted process group of its own."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook is None:
        return None
    traffic = GradientTraffic(group=dist.new_group())  # every rank, same order: the ranks of the default group
    traffic.counting()
    if hook == "allreduce":
        model.register_comm_hook(traffic.group, default_hooks.allreduce_hook)
        return traffic

    class OnCountedGroup:  # what accelerate's registration calls, with the group put in
        @staticmethod
        def register_comm_hook(state, hook):
            if isinstance(state, powerSGD_hook.PowerSGDState):
                state.process_group = traffic.group
            model.register_comm_hook(state if state is not None else traffic.group, hook)

    if hook == "batched_power_sgd":
        orthogonalize_single_matrices_too()
    power_sgd = {"matrix_approximation_rank": power_sgd_rank, "start_powerSGD_iter": power_sgd_start_step}
    # --ddp_comm_hook's names are accelerate's DDPCommunicationHookType values
    DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(hook),
                                  comm_state_option=power_sgd if "power_sgd" in hook else {}).register_comm_hook(OnCountedGroup)
    return traffic


def orthogonalize_single_matrices_too() -> None:
    """torch 2.13's `batched_powerSGD_hook` orthogonalises one 2-D matrix per bucket with `_orthogonalize`, which
    since pytorch#75157 accepts batches (3-D) only and raises AssertionError at the first compressed step: give it
    the matrix as a batch of one (a view: the result lands in the matrix). tests/test_compression.py fails once
    torch no longer needs this."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    batches_only = powerSGD_hook._orthogonalize
    if getattr(batches_only, "accepts_single_matrices", False):
        return

    def orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
        batches_only(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    orthogonalize.accepts_single_matrices = True
    powerSGD_hook._orthogonalize = orthogonalize


def power_sgd_state(model: torch.nn.Module):
    """The PowerSGDState DDP holds for its hook, if the model runs PowerSGD."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    return next((state for _, state in getattr(model, "_comm_hooks", []) if isinstance(state, PowerSGDState)), None)


def save_power_sgd(state, accelerator: Accelerator, directory: Path) -> None:
    """This rank's PowerSGD state, in the checkpoint being written."""
    torch.save(power_sgd_state_dict(state), directory / POWER_SGD_STATE.format(rank=accelerator.process_index))


def load_power_sgd(state, accelerator: Accelerator, directory: Path) -> None:
    """Every rank alike: its own state when the checkpoint holds one per rank of this run; else rank 0's step
    count, generator and warm start (the same on every rank), with the per-rank error feedback started afresh on
    every rank (saved by another number of processes); else nothing (saved without PowerSGD)."""
    saved = sorted(directory.glob(POWER_SGD_STATE.format(rank="*")))
    if not saved:
        logger.warning(f"{directory} holds no PowerSGD state: it starts afresh", main_process_only=True)
        return
    if len(saved) == accelerator.num_processes:
        load_power_sgd_state_dict(state, torch.load(directory / POWER_SGD_STATE.format(rank=accelerator.process_index),
                                                    weights_only=True))
        return
    shared = torch.load(directory / POWER_SGD_STATE.format(rank=0), weights_only=True) | {"error_dict": {}}
    load_power_sgd_state_dict(state, shared)
    logger.warning(f"PowerSGD's state was saved by {len(saved)} processes: every rank resumes at its step "
                   f"{state.iter}, with its error feedback started afresh", main_process_only=True)


def power_sgd_state_dict(state) -> dict:
    """Everything PowerSGD carries from step to step, as tensors and numbers (weights-only loadable)."""
    kind, keys, position, has_gauss, cached_gaussian = state.rng.get_state()
    return {"iter": state.iter, "error_dict": state.error_dict, "p_memory_dict": state.p_memory_dict,
            "q_memory_dict": state.q_memory_dict, "rng_keys": torch.from_numpy(keys.astype(np.int64)),
            "rng": [kind, position, has_gauss, cached_gaussian],
            "numel": [state.total_numel_before_compression, state.total_numel_after_compression]}


def load_power_sgd_state_dict(state, saved: dict) -> None:
    kind, position, has_gauss, cached_gaussian = saved["rng"]
    state.rng.set_state((kind, saved["rng_keys"].numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    state.iter, state.error_dict = saved["iter"], saved["error_dict"]
    state.p_memory_dict, state.q_memory_dict = saved["p_memory_dict"], saved["q_memory_dict"]
    state.total_numel_before_compression, state.total_numel_after_compression = saved["numel"]
