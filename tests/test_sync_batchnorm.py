"""parts/sync_batchnorm (`--sync_batchnorm`): what it converts, and its one-line refusal on CPU, where torch
has no kernels for SyncBatchNorm."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from parts.sync_batchnorm.convert import convert_sync_batchnorm
from tests.harness import bad_input_errors, launch

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


@pytest.mark.quick
def test_one_process_or_no_batchnorm_leaves_the_model_as_it_is() -> None:
    accelerator = Accelerator(cpu=True)  # one process
    try:
        plain = torch.nn.Linear(2, 2)
        assert convert_sync_batchnorm(plain, accelerator) == (
            plain, "--sync_batchnorm: the model has no BatchNorm layers; nothing to synchronise")
        normed = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
        assert convert_sync_batchnorm(normed, accelerator) == (
            normed, "--sync_batchnorm: one process sees the whole batch already; BatchNorm left as it is")
    finally:  # the next test in this worker builds its own
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parts("images")
def test_sync_batchnorm_on_cpu_processes_is_one_error_line_and_exit_2(tmp_path) -> None:
    result = launch("ddp", "train.py", "--task", "image-classification", "--model_config", "resnet-tiny",
                    "--max_steps", "2", "--output_dir", str(tmp_path), "--sync_batchnorm", timeout=180)
    errors = bad_input_errors(result)
    assert len(errors) == 1 and errors[0].startswith(
        "error: --sync_batchnorm needs GPUs: torch has no CPU kernels for SyncBatchNorm"), result.stderr[-4000:]
    assert not list(tmp_path.iterdir())  # refused before anything was written
