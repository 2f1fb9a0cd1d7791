"""The devices' peak FLOP/s (NVIDIA's datasheets; a probe on CPU) and MFU as figures of train.py's speed meter."""

from __future__ import annotations

import time

import torch
from accelerate import Accelerator

from training.collectives import gather_scalars
from training.performance import compute_dtype

TF32 = "tf32"  # fp32 matmuls on tensor cores (--tf32)


def _peaks(half: float, tf32: float, fp32: float) -> dict[torch.dtype | str, float]:
    return {torch.bfloat16: half, torch.float16: half, TF32: tf32, torch.float32: fp32}  # fp16 runs at bf16's rate


# Dense peak FLOP/s from NVIDIA's datasheets (no 2:4 sparsity), by a fragment of
# `torch.cuda.get_device_name()`: the first fragment the name contains wins, so the NVL and
# PCIe variants come before plain "H200"/"H100" (SXM). fp32 is true fp32 (torch's default
# matmul precision); TF32 is the tensor-core rate for fp32 under --tf32.
GPU_PEAK_FLOPS: dict[str, dict[torch.dtype | str, float]] = {
    "H200 NVL": _peaks(835.5e12, 417.5e12, 60.0e12),
    "H200": _peaks(989.4e12, 494.7e12, 66.9e12),
    "H100 NVL": _peaks(835.5e12, 417.5e12, 60.0e12),
    "H100 PCIe": _peaks(756.0e12, 378.0e12, 51.2e12),
    "H100": _peaks(989.4e12, 494.7e12, 66.9e12),  # SXM: "NVIDIA H100 80GB HBM3"
    "A100": _peaks(312.0e12, 156.0e12, 19.5e12),
}


def gpu_peak_flops(name: str, dtype: torch.dtype | str) -> float | None:
    """The datasheet peak for a GPU called `name`, or None if the table does not know it."""
    return next((peaks.get(dtype) for fragment, peaks in GPU_PEAK_FLOPS.items() if fragment in name), None)


def measured_matmul_flops(dtype: torch.dtype, size: int = 512, seconds: float = 0.1) -> float:
    """The best FLOP/s of square matmuls on this process's CPU threads, over `seconds`."""
    # Its own generator: drawing from the global RNG would shift dropout's masks, and a resumed run
    # (which restores that RNG, then probes again) would train differently from an uninterrupted one.
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, dtype=dtype, generator=generator) for _ in range(2))
    a @ b  # warm-up: thread pool and kernels
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
    return best


def device_peak_flops(accelerator: Accelerator) -> float | None:
    """This rank's device's peak matmul FLOP/s in the run's compute dtype (fp32 as TF32 when torch allows it): the
    datasheet on known GPUs; on CPU a probe, run by the main process alone while the others wait (a probe alone is
    not slowed by the other ranks' probes). A collective: see `agreed_peak`."""
    dtype, device = compute_dtype(accelerator.mixed_precision), accelerator.device
    own = 0.0  # unknown
    if device.type == "cuda":
        tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        own = gpu_peak_flops(torch.cuda.get_device_name(device), TF32 if tf32 else dtype) or 0.0
    elif device.type == "cpu" and accelerator.is_main_process:
        own = measured_matmul_flops(dtype)
    return agreed_peak(own, gather_scalars(accelerator, {"peak": own})["peak"], device.type == "cpu")


def agreed_peak(own: float, everyone: torch.Tensor, on_cpu: bool) -> float | None:
    """The peak this rank counts MFU against, decided alike on every rank (each must log the same figures): on CPU
    the main process's probe (the same kind of cores on every node); on GPUs its own datasheet figure, or None on
    every rank when any rank's GPU is not in the table."""
    if on_cpu:
        return float(everyone.max()) or None
    return own if bool((everyone > 0).all()) else None


class Mfu:
    """MFU as `LoggedFigures` (training/performance.py): each rank's peak, then the rate over the ranks' summed peak."""

    steady = ("mfu",)

    def __init__(self, device: torch.device, flops_per_unit: float, peak: float, ranks_per_batch: int = 1) -> None:
        self.device, self.flops_per_unit, self.peak, self.ranks_per_batch = device, flops_per_unit, peak, ranks_per_batch

    def local(self, units: int, seconds: float, whole_run: bool) -> dict[str, float]:
        if self.device.type != "cpu":
            return {"peak_flops": self.peak}
        # A CPU's peak is a 0.1 s probe, a lower bound: another process may have slowed it. The
        # run's own FLOP/s are a lower bound too, so MFU stays at most 100%.
        return {"peak_flops": max(self.peak, units / seconds * self.flops_per_unit / self.ranks_per_batch)}

    def report(self, ranks: dict[str, torch.Tensor], units_per_sec: float) -> dict[str, float]:
        # the peak beside the MFU, so that a reader recomputes it: units/s x flops per unit / peak
        peak = float(ranks["peak_flops"].sum())
        return {"peak_flops": peak, "mfu": units_per_sec * self.flops_per_unit / peak}
