"""CPU settings that make a step as fast as a hand-written loop's: each process's share of the cores, and freed
memory kept for the next step."""

from __future__ import annotations

import ctypes
import os
import platform


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
