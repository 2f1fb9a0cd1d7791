"""The GPU path: its decisions checked on CPU from the values a GPU machine gives, and (marked
`gpu`, skipped without one) short bf16 runs on a GPU against the CPU's fp32 losses."""

from __future__ import annotations

import pytest

from tests.harness import TINY_RUN, launch, read_metrics, train, with_processes

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


GPU_STEPS = 8


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["ddp", "fsdp", "deepspeed_zero3"])
def test_bf16_on_one_gpu_follows_the_cpu_fp32_losses(config, tmp_path) -> None:
    """A few steps with bf16 on 1 GPU (NCCL, CUDA) against the same config in fp32 on CPU: the
    per-step losses agree within bf16's precision. Passed on an H100 (docs/gpus.md)."""
    one_process = with_processes(config, 1, tmp_path / "configs")
    args = ("--max_steps", str(GPU_STEPS), "--logging_steps", "1", "--eval_steps", "100", "--block_size", "64")
    cpu = train(one_process, tmp_path / "cpu", *args)
    gpu = launch(one_process, "train.py", *TINY_RUN, "--output_dir", str(tmp_path / "gpu"), *args,
                 launcher_args=("--mixed_precision", "bf16"), gpu=True)
    assert gpu.returncode == 0, gpu.stderr[-6000:]
    assert "device=cuda" in gpu.stderr and "mixed_precision=bf16" in gpu.stderr and "backend=nccl" in gpu.stderr
    assert "device=cpu" in cpu.stderr
    losses = {run: [m["loss"] for m in read_metrics(tmp_path / run) if "loss" in m] for run in ("cpu", "gpu")}
    assert len(losses["gpu"]) == GPU_STEPS
    assert losses["gpu"] == pytest.approx(losses["cpu"], rel=2e-2)  # bf16 keeps 8 bits of mantissa

