"""Owns the CPU accommodations: what lets every strategy run for real without a GPU (gloo), and only there.

Why each is needed (measured with accelerate 1.15.0; tests/test_cpu_accommodation.py fails if that changes):
- DDP: accelerate picks gloo only given `Accelerator(cpu=True)`; else each process trains alone, world size 1.
- DeepSpeed: without `InitProcessGroupKwargs(backend="gloo")` accelerate counts one process, DeepSpeed N, and
  batch-size checks fail.
- FSDP: accelerate refuses FSDP on CPU and silently falls back, though FSDP2 trains on gloo: we start the gloo
  group and mark the run multi-device, so `AcceleratorState` turns the FSDP plugin on exactly as on GPUs.
What makes CPU steps fast (threads, malloc) is the part parts/cpu_settings.
"""

from __future__ import annotations

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
