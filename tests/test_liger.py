"""parts/liger: Liger's kernels (`--use_liger_kernel`), refused in one line where they cannot run; on a GPU
(marked `gpu`, skipped without one) a run with them follows the plain bf16 run's losses."""

from __future__ import annotations

import pytest
import torch

from parts.liger.kernels import apply_liger_kernel, on_gpu_tensors
from tests.harness import TINY_RUN, bad_input_errors, launch, read_metrics, with_processes
from tests.test_gpu_path import GPU_STEPS
from training.errors import ArgumentError

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


@pytest.mark.quick
def test_liger_kernel_is_refused_in_one_line_where_it_cannot_run() -> None:
    """On CPU; then as on a GPU machine: without liger-kernel (an optional install), or for a model it has no
    kernels for."""
    with pytest.raises(ArgumentError, match="runs Triton kernels on NVIDIA GPUs; this run is on cpu: drop the flag"):
        apply_liger_kernel(torch.nn.Linear(2, 2), torch.device("cpu"))
    try:
        import liger_kernel.transformers.monkey_patch  # noqa: F401 (needs triton, which CPU builds of torch lack)
        refusal = "liger-kernel has no kernels for model type None: drop the flag"
    except ImportError:
        refusal = r"--use_liger_kernel needs liger-kernel \(.*\): pip install liger-kernel==0.8.5, or drop the flag"
    with pytest.raises(ArgumentError, match=refusal):
        apply_liger_kernel(torch.nn.Linear(2, 2), torch.device("cuda"))


@pytest.mark.quick
def test_liger_rope_leaves_cpu_tensors_to_transformers() -> None:
    """Liger's RoPE, swapped into transformers' modeling module for the whole process, must leave the CPU sample
    of final/ (after training, same process) to transformers' own function: Triton cannot run on CPU tensors."""
    def transformers_rope(q, k, cos, sin, unsqueeze_dim=1):
        return q * cos, k * sin * unsqueeze_dim

    def liger_rope(*args, **kwargs):
        raise AssertionError("Liger's kernel called with CPU tensors")

    rope = on_gpu_tensors(liger_rope, transformers_rope)
    q, k, cos, sin = (torch.full((2, 3), value) for value in (1.0, 2.0, 3.0, 4.0))
    assert rope.__name__ == "transformers_rope"
    for got, expected in zip(rope(q, k, cos, sin, unsqueeze_dim=2), (q * cos, k * sin * 2)):
        assert torch.equal(got, expected)


def test_a_cpu_launch_with_liger_kernels_is_one_error_line_and_exit_2(tmp_path) -> None:
    """Through the part's hook in a real launch: the flag is train.py's (the part's flags), and the refusal is
    bad input (training/errors.py)."""
    result = launch("ddp", "train.py", *TINY_RUN, "--output_dir", str(tmp_path), "--use_liger_kernel")
    assert bad_input_errors(result) == [
        "error: --use_liger_kernel runs Triton kernels on NVIDIA GPUs; this run is on cpu: drop the flag"]


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [
    ("--use_liger_kernel",),
    pytest.param(("--use_liger_kernel", "--fused_linear_cross_entropy"), marks=pytest.mark.parts("fused_loss")),
], ids=["norms, SwiGLU and RoPE", "and the fused loss"])
def test_liger_kernels_follow_the_plain_bf16_losses(flags: tuple[str, ...], tmp_path) -> None:
    """--use_liger_kernel (fused RMSNorm, SwiGLU and RoPE; with --fused_linear_cross_entropy also Liger's linear
    cross-entropy) against the same bf16 run without it, on 1 GPU; the run's sample of final/ on CPU, after it, uses
    transformers' own modules and RoPE. The first case passed on an H200 without RoPE (docs/gpus.md); RoPE and the
    second case have not run on a GPU yet."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is an optional install (pip install liger-kernel==0.8.5)")
    one_process = with_processes("ddp", 1, tmp_path / "configs")
    args = ("--max_steps", str(GPU_STEPS), "--logging_steps", "1", "--eval_steps", "100", "--block_size", "64")
    for run, run_flags in {"plain": (), "liger": flags}.items():
        result = launch(one_process, "train.py", *TINY_RUN, "--output_dir", str(tmp_path / run), *args, *run_flags,
                        launcher_args=("--mixed_precision", "bf16"), gpu=True)
        assert result.returncode == 0, result.stderr[-6000:]
    losses = {run: [m["loss"] for m in read_metrics(tmp_path / run) if "loss" in m] for run in ("plain", "liger")}
    assert len(losses["liger"]) == GPU_STEPS
    assert losses["liger"] == pytest.approx(losses["plain"], rel=1e-2)
    assert losses["liger"] != losses["plain"]  # other kernels ran: bf16 rounds them differently
