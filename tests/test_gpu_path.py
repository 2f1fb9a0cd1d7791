"""Decisions of the GPU path, checked on CPU from the values a GPU machine gives."""

from __future__ import annotations

import pytest

from training.distributed import idle_gpus


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
