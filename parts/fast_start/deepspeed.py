"""What DeepSpeed (0.19.8) and py-cpuinfo do at start-up that train.py does not need, and how each is skipped."""

from __future__ import annotations

import functools
import importlib
import sys
import types


def skip_deepspeed_muon_check() -> None:
    """ZeRO imports DeepSpeed's Muon optimizer to ask whether the optimizer is one, and its Muon update
    in the gradient reduction whether it is used or not; that module compiles with torch's inductor as it
    loads: 1.5 s of CPU per rank at every start (measured, DeepSpeed 0.19.8). train.py never builds Muon
    (`--optim`): stand-in modules answer instead, with a class nothing is an instance of."""
    def never_called(*_args, **_kwargs):
        raise RuntimeError("DeepSpeed's Muon update was called, but train.py builds no Muon optimizer")

    muon = type("MuonWithAuxAdam", (), {})
    for name, names in {"muon_optimizer": {"MuonWithAuxAdam": muon},
                        "original_muon": {"MuonWithAuxAdam": muon, "muon_update": never_called,
                                          "adam_update": never_called}}.items():
        stand_in = types.ModuleType(f"deepspeed.runtime.zero.muon.{name}")
        stand_in.__dict__.update(names)
        sys.modules.setdefault(stand_in.__name__, stand_in)


def skip_deepspeed_inference_kernel() -> None:
    """On CPU, DeepSpeed compiles a shared-memory all-reduce as it starts (45 to 60 s on the first
    launch in each environment, and a line per rank), which only its inference engine uses
    (`inference_all_reduce`); training collectives go through torch.distributed either way."""
    backend = importlib.import_module("deepspeed.comm.torch")  # not `deepspeed.comm.torch`: that name is torch itself
    backend.build_shm_op = lambda: None


def ask_cpuinfo_once() -> None:
    """DeepSpeed's CPU Adam asks py-cpuinfo about the CPU three times as it loads (twice for its build
    flags, once for the vendor), and py-cpuinfo answers each time from two new Python processes: 1.2 s
    each, per rank (measured, DeepSpeed 0.19.8). The CPU does not change within a process: the first
    answer is kept."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def build_without_debug_symbols() -> None:
    """DeepSpeed compiles CPU Adam with `-g`: debug symbols nobody here reads, which take a third of the build.
    Measured on 2 cores (DeepSpeed 0.19.8, torch 2.13): its two sources compile in 55 s with `-g`, 39 s without."""
    from deepspeed.ops.op_builder import CPUAdamBuilder  # the builder DeepSpeedCPUAdam loads with, on this machine

    with_symbols = CPUAdamBuilder.cxx_args
    if getattr(with_symbols, "without_debug_symbols", False):
        return

    def cxx_args(builder) -> list[str]:
        return [flag for flag in with_symbols(builder) if flag != "-g"]

    cxx_args.without_debug_symbols = True
    CPUAdamBuilder.cxx_args = cxx_args
