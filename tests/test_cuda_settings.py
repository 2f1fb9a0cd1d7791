"""The part cuda_settings: each GPU default decided from its inputs and torch's switches set; idle GPUs named."""

from __future__ import annotations

import pytest
import torch

from parts.cuda_settings.settings import idle_gpus, loader_workers, use_tf32

pytestmark = pytest.mark.quick  # every test here: the quick tier (pytest -m quick)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    ("requested", "device", "mixed_precision", "enabled"),
    [(None, CUDA, "no", True),  # fp32 training on a GPU: tensor cores by default
     (None, CUDA, "bf16", False), (True, CUDA, "bf16", True), (False, CUDA, "no", False),
     (None, CPU, "no", False), (True, CPU, "no", False)],  # CPUs have no TF32
)
def test_tf32_is_on_for_fp32_gpu_runs_unless_told(requested, device, mixed_precision, enabled) -> None:
    try:
        assert use_tf32(requested, device, mixed_precision) is enabled
        assert torch.backends.cuda.matmul.allow_tf32 is enabled and torch.backends.cudnn.allow_tf32 is enabled
    finally:
        use_tf32(False, CPU, "no")


@pytest.mark.parametrize(("usable", "cores", "processes", "workers"), [
    (16, 16, 2, 4),  # 8 cores each, one for the loop: 7, at most 4
    (16, 16, 8, 1),  # 2 cores each: one for the loop, one worker
    (2, 2, 1, 1),
    (1, 1, 1, 0),  # no core to spare: batches load in the loop
    (3, 64, 8, 2),  # bound to 3 of 64 cores (SLURM's --cpus-per-task): those are this process's own
])
def test_loader_workers_default_to_none_on_cpu_and_a_few_on_gpus(usable, cores, processes, workers, monkeypatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(usable)))
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert loader_workers(None, CUDA, local_processes=processes) == workers
    assert loader_workers(None, CPU, local_processes=processes) == 0
    assert loader_workers(3, CPU, local_processes=2) == 3  # the flag wins


@pytest.mark.parametrize(
    ("local_processes", "local_gpus", "machines", "launch_hint"),
    [(2, 8, 1, "--num_processes 8"), (2, 8, 2, "--num_processes 16"), (8, 8, 2, None), (1, 1, 1, None)],
)
def test_idle_gpus_are_named_with_the_launch_that_uses_them(local_processes, local_gpus, machines, launch_hint) -> None:
    warning = idle_gpus(local_processes, local_gpus, machines)
    if launch_hint is None:
        assert warning is None
    else:
        assert f"this machine has {local_gpus} GPUs but {local_processes} process(es) run on it" in warning
        assert launch_hint in warning
