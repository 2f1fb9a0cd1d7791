"""Owns the CPU accommodations: what lets every strategy run for real without a GPU (gloo), and only there.

Why each accommodation is needed (measured with accelerate 1.15.0):
- DDP: accelerate only picks the gloo CPU backend when told `Accelerator(cpu=True)`;
  otherwise each of the N launched processes trains alone with world size 1.
- DeepSpeed: without `InitProcessGroupKwargs(backend="gloo")` accelerate counts one
  process while DeepSpeed counts N, and batch-size checks fail.
- FSDP: accelerate's device detection refuses FSDP on CPU and falls back silently
  (independent single-process runs, or plain DDP with `cpu=True`). FSDP2 itself trains
  on gloo. So we start accelerate's process group on gloo with device `cpu`, then mark
  the run as multi-device so that `AcceleratorState` activates the FSDP plugin exactly
  as it does on GPUs. `tests/test_cpu_accommodation.py` fails loudly if a new accelerate
  changes either the refusal or the behaviour this relies on.
On a GPU machine none of this applies: the same config files run unmodified over NCCL.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import NamedTuple

from accelerate import PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from training.strategy import Strategy


class CpuSettings(NamedTuple):
    cpu: bool  # Accelerator(cpu=...): gloo for single and DDP
    backend: str | None  # InitProcessGroupKwargs(backend=...): passed on only when it differs from its default


def cpu_process_group(strategy: Strategy, timeout: timedelta) -> CpuSettings:
    """Start what accelerate would not start on CPU by itself; the Accelerator's settings for the rest."""
    if strategy is Strategy.FSDP:
        state = PartialState(backend="gloo", timeout=timeout)  # a gloo process group on device cpu, type NO
        state.distributed_type = DistributedType.MULTI_GPU  # so AcceleratorState turns on the FSDP plugin
    backend = "gloo" if strategy is Strategy.DEEPSPEED else InitProcessGroupKwargs.backend
    return CpuSettings(cpu=strategy in (Strategy.SINGLE, Strategy.DDP), backend=backend)


def use_share_of_cores(local_processes: int) -> str:
    """Without a GPU, each process computes on its share of the cores it may run on, unless the user chose a
    count (OMP_NUM_THREADS, or `accelerate launch --num_cpu_threads_per_process`); returns it for the log.

    accelerate's launcher gives each process OMP_NUM_THREADS=1 unless told otherwise: the default job used
    one of this machine's two cores (24,376 tokens/s, against 42,238 with both). The rank cannot tell the
    launcher's 1 from the user's in its own environment, so it reads what its launcher was started with.
    """
    import psutil
    import torch

    launcher = psutil.Process().parent()
    try:
        chosen = "OMP_NUM_THREADS" in launcher.environ() or any(
            argument.startswith("--num_cpu_threads_per_process") for argument in launcher.cmdline())
    except psutil.Error:  # a launcher of another user, or gone: keep what the environment says
        chosen = True
    if not chosen:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(local_processes, 1)))
    threads = torch.get_num_threads()
    return f"{threads} CPU thread{'s' if threads > 1 else ''} per process{' (as set)' if chosen else ''}"
