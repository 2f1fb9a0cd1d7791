"""Owns the CPU accommodations: what lets every strategy run for real without a GPU (gloo), and only there.

Why each is needed (measured with accelerate 1.15.0; tests/test_cpu_accommodation.py fails if that changes):
- DDP: accelerate picks gloo only given `Accelerator(cpu=True)`; else each process trains alone, world size 1.
- DeepSpeed: without `InitProcessGroupKwargs(backend="gloo")` accelerate counts one process, DeepSpeed N, and
  batch-size checks fail.
- FSDP: accelerate refuses FSDP on CPU and silently falls back, though FSDP2 trains on gloo: we start the gloo
  group and mark the run multi-device, so `AcceleratorState` turns the FSDP plugin on exactly as on GPUs.
Two make CPU steps as fast as a hand-written loop's: each process's share of the cores, and freed memory kept.
"""

from __future__ import annotations

import ctypes
import os
import platform
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
    """Without a GPU, each process computes on its share of cores unless the user set a count; returns it for the log.
    accelerate's launcher sets OMP_NUM_THREADS=1 (one of two cores: 24,376 tokens/s, against 42,238 with both), and
    a rank cannot tell that 1 from the user's, so it reads the environment its launcher was started with."""
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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MALLOC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> None:
    """On CPU a step's activations live in malloc's memory. glibc gives freed memory at the heap's top back to the
    OS and maps large blocks afresh, so each step faulted its pages in again: 8,000 to 10,500 minor page faults
    per step on `llama-small` (2 processes, bf16) against 1,100 in scripts/raw_ddp.py, and 3% of the step
    (docs/performance.md). Kept instead, as torch's CPU launcher (`torch.backends.xeon.run_cpu`) keeps it by
    preloading tcmalloc: glibc's heap is never trimmed, and blocks up to 32 MiB (its limit) come from it. Unless
    the user set the allocator up (its variables, or another malloc preloaded)."""
    chosen = any(name in os.environ for name in MALLOC_SETTINGS) or "malloc" in os.environ.get("LD_PRELOAD", "")
    if chosen or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(M_TRIM_THRESHOLD, -1)  # -1: never trim (mallopt(3))
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
