"""parts/safe_loading: a tampered checkpoint is refused in one line and runs no code; what checkpoints legitimately
hold (an enum pickled through getattr) still loads."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from parts.safe_loading.unpickling import check_dcp_metadata, safe_unpickling
from tests.harness import SPLIT_OF, TINY_RUN, bad_input_errors, launch, split_run_args
from training.checkpoints.files import MANIFEST, checkpoint_files, file_sha256, write_manifest

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


class CodeOnLoad:
    """What a tampered checkpoint holds: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


TAMPERED = {  # config -> a file its checkpoint loads with pickle, and how to write a payload there
    "deepspeed_zero2": ("scheduler.bin", torch.save),  # accelerate's torch.load (model_state/ is safetensors)
}


@pytest.mark.parametrize("config", TAMPERED)
def test_a_checkpoint_that_would_run_code_on_load_is_refused(config, split_run, uneven_data, tmp_path) -> None:
    """What accelerate's save_state pickles (the schedule, RNG, the parts' objects) loads weights-only: no code runs."""
    args = split_run_args(uneven_data, SPLIT_OF[config])
    checkpoint = tmp_path / "checkpoints" / "step_8"
    shutil.copytree(split_run(SPLIT_OF[config]) / "checkpoints" / "step_8", checkpoint)
    marker = tmp_path / "code-ran"
    file, write = TAMPERED[config]
    write({"state": CodeOnLoad(marker)}, checkpoint / file)
    # as one who tampers can: the manifest written again, its sizes and SHA-256s then hold, and unpickling is left
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    write_manifest(checkpoint, manifest["run_id"], manifest["step"],
                   {name: file_sha256(checkpoint / name) for name in checkpoint_files(checkpoint)}, manifest["tensors"])

    result = launch(config, "train.py", *TINY_RUN, "--output_dir", str(tmp_path), *args,
                    "--resume_from_checkpoint", "latest", timeout=180)
    errors = bad_input_errors(result)
    assert errors and "refused to load them, as unpickling can run code" in errors[0], result.stderr[-4000:]
    assert not marker.exists()


class PickledByGetattr:
    """How some Python releases (3.11.2) pickle an enum's member, on any Python: `getattr(owner, name)`."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


@pytest.mark.quick
def test_an_enum_pickled_through_getattr_loads_and_no_other_getattr_does(tmp_path) -> None:
    """Checkpoints written under Python 3.11.2 hold DeepSpeed's ZeRO stage and DCP's memory-format enum that way
    (found on a fresh machine: every DeepSpeed and FSDP2 resume was refused); nothing else may use getattr."""
    from collections import OrderedDict

    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    torch.save({"zero_stage": PickledByGetattr(ZeroStageEnum, "weights")}, tmp_path / "stage.pt")
    torch.save({"loss_scaler": PickledByGetattr(LossScaler, "__init__")}, tmp_path / "method.pt")
    with safe_unpickling(tmp_path, deepspeed=True):
        assert torch.load(tmp_path / "stage.pt")["zero_stage"] is ZeroStageEnum.weights
        with pytest.raises(pickle.UnpicklingError):
            torch.load(tmp_path / "method.pt")
    for name, payload, allowed in (("enum", PickledByGetattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT"), True),
                                   ("method", PickledByGetattr(OrderedDict, "fromkeys"), False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(pickle.dumps(payload))
        if allowed:
            check_dcp_metadata(tmp_path / name)
        else:
            with pytest.raises(pickle.UnpicklingError, match="is not allowed in a checkpoint"):
                check_dcp_metadata(tmp_path / name)
