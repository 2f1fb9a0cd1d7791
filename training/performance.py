"""How fast and how big: model FLOPs per token, throughput, peak memory, and the bytes of tensors each rank really
holds (parts/memory_plan measures the model state with it). MFU, from the device's peak: parts/mfu."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Iterable
from typing import Protocol

import torch


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12·L·d·T (PaLM, appendix B): N the parameters in matrix multiplies (all but
    an untied input embedding), 12·L·d·T attention over T tokens. A model whose config does not describe its
    attention (a custom model) counts as 6N. Call it before `prepare` (ZeRO-3 partitions count by full size)."""
    config = getattr(model, "config", None)
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None
    )
    if not (layers and heads and head_dim):
        return 6 * parameter_count(model)
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    matmul_params = parameter_count(model) - (0 if tied else _full_numel(embedding))
    return 6 * matmul_params + 12 * layers * heads * head_dim * seq_len


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process on `device`: allocated memory on a GPU, resident memory (RSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _held(tensor: torch.Tensor) -> list[torch.Tensor]:
    """What this rank stores of a tensor: a DTensor's shard (FSDP2); a ZeRO-3 partition, plus the full tensor while
    gathered (always, under DeepSpeed's persistence threshold); or the tensor."""
    if hasattr(tensor, "to_local"):
        return [tensor.to_local()]
    if getattr(tensor, "ds_tensor", None) is not None:
        return [tensor.ds_tensor, tensor]  # a released ZeRO-3 parameter's own storage is empty
    return [tensor]


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the distinct storages behind `tensors` not yet in `seen` (views share a storage)."""
    total = 0
    for storage in (held.untyped_storage() for tensor in tensors for held in _held(tensor)):
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class LoggedFigures(Protocol):
    """A part's figures logged beside the loss and throughput (parts/mfu: MFU; parts/dpo: rewards): each rank's
    (`local`), gathered with the rest, then combined (`report`). `local` is called at each logged interval, with the
    interval's units and seconds, and once more at the end for summary.json (`whole_run`), with the launch's: a part
    that counts its own events keeps the run's totals apart from the interval's."""

    steady: tuple[str, ...]  # of `report`'s keys, those summary.json also gets as medians after warm-up

    def local(self, units: int, seconds: float, whole_run: bool) -> dict[str, float]: ...

    def report(self, ranks: dict[str, torch.Tensor], units_per_sec: float) -> dict[str, float]: ...


class SpeedMeter:
    """Throughput (`unit`s/s), step time and peak memory over the optimizer steps since the last report, and the
    parts' figures (`LoggedFigures`).

    A step's clock runs from the end of the step before (or `resume`) to its `end_step`, loading included; logging,
    evaluation and saves pause it. The whole-run figures leave out a launch's first step (start-up, torch.compile:
    50 s on an H100). Every step before a pause waits for the device inside its clock (a clock restarted at each
    step lost device time: 184% MFU on an H200 under torch.compile, docs/gpus.md).
    """

    def __init__(
        self, device: torch.device, unit: str = "tokens", ranks_per_batch: int = 1,
        memory_devices: list[torch.device] | None = None, figures: list[LoggedFigures] | None = None,
    ) -> None:
        self.device, self.unit, self.figures = device, unit, figures or []
        # one process holding layers on several GPUs (parts/layer_split): each with its own peak
        self.memory_devices = memory_devices or [device]
        self.ranks_per_batch = ranks_per_batch  # tensor parallelism: a group of ranks works on one batch
        self.units = self.steps = self.total_units = self.total_steps = 0
        self.seconds = self.total_seconds = 0.0
        self.first_step: tuple[int, float] = (0, 0.0)  # units, seconds
        self.reported: list[dict[str, float]] = []  # each logged interval's figures, for `steady_state`
        self._started = 0.0

    def resume(self) -> None:
        """Start the clock: before the first step, and after logging, evaluation or a checkpoint."""
        self._started = time.perf_counter()

    def end_step(self, units: int, synchronize: bool = False) -> None:
        """`synchronize` on the steps that report: the GPU work still queued belongs to this interval's clock."""
        if synchronize and self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self._started = now - self._started, now  # the next step's clock starts at once
        self.units, self.steps, self.seconds = self.units + units, self.steps + 1, self.seconds + elapsed
        if self.first_step[1]:  # not the launch's first step
            self.total_units, self.total_seconds = self.total_units + units, self.total_seconds + elapsed
            self.total_steps += 1
        else:
            self.first_step = (units, elapsed)

    def interval(self) -> dict[str, float]:
        """This rank's figures since the last call, for `collectives.gather_scalars`; starts the next interval."""
        figures = self._local(self.units, self.steps, self.seconds, whole_run=False)
        self.units = self.steps = 0
        self.seconds = 0.0
        return figures

    def whole_run(self) -> dict[str, float]:
        """This rank's figures over the launch's steps after its first (or the first, if alone)."""
        if self.total_steps:
            return self._local(self.total_units, self.total_steps, self.total_seconds, whole_run=True)
        return self._local(self.first_step[0], 1, self.first_step[1], whole_run=True)

    def _local(self, units: int, steps: int, seconds: float, whole_run: bool) -> dict[str, float]:
        seconds = max(seconds, 1e-9)
        # by position, not device name: every rank must send the same names (rank 1's GPU is its cuda:1)
        peaks = {f"peak_memory {i}": peak_memory_bytes(device) for i, device in enumerate(self.memory_devices)}
        figures = {key: value for part in self.figures for key, value in part.local(units, seconds, whole_run).items()}
        return {"units_per_sec": units / seconds, "step_time": seconds / max(steps, 1), **peaks, **figures}

    def report(self, ranks: dict[str, torch.Tensor]) -> dict[str, float]:
        """The figures of all ranks together, from `gather_scalars` of `interval()` or `whole_run()`."""
        units_per_sec = float(ranks["units_per_sec"].sum()) / self.ranks_per_batch
        peaks = {str(device): float(ranks[f"peak_memory {i}"].max()) / 2**30 for i, device in enumerate(self.memory_devices)}
        report = {
            f"{self.unit}_per_sec": units_per_sec,
            "step_time": float(ranks["step_time"].max()),  # the slowest rank sets the pace
            "peak_memory_gb": max(peaks.values()),  # the fullest device of the fullest rank
        }
        if len(peaks) > 1:
            report |= {f"peak_memory_gb_{device.replace(':', '')}": gb for device, gb in peaks.items()}
        return report | {key: value for part in self.figures for key, value in part.report(ranks, units_per_sec).items()}

    def report_interval(self, ranks: dict[str, torch.Tensor]) -> dict[str, float]:
        """`report` of a logged interval (`gather_scalars` of `interval()`), kept for `steady_state`."""
        self.reported.append(self.report(ranks))
        return self.reported[-1]

    def steady_state(self) -> dict[str, float]:
        """Medians over the logged intervals after the first (the warm-up): `steady_<unit>_per_sec`,
        `steady_step_time` and the parts' (`steady_mfu`); empty with fewer than two intervals."""
        after_warm_up = self.reported[1:]
        keys = [f"{self.unit}_per_sec", "step_time", *(key for part in self.figures for key in part.steady)]
        logged = {key: [r[key] for r in after_warm_up if key in r] for key in keys}  # (a part's: not every interval)
        return {f"steady_{key}": statistics.median(values) for key, values in logged.items() if values}


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters of the whole model (ZeRO-3 partitions by their full size)."""
    return sum(_full_numel(p) for p in model.parameters())


def _full_numel(param: torch.Tensor) -> int:
    return getattr(param, "ds_numel", param.numel())  # a ZeRO-3 partition knows its full size


def compute_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype matmuls run in under accelerate's `mixed_precision`."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)
