"""parts/fast_start: each piece of DeepSpeed's start-up work it skips is skipped, in a fresh interpreter as a rank
starts (every DeepSpeed run of the suite then trains with them: tests/test_parity.py and the rest); a build lock
left by a killed build is released, one still held is kept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parts.fast_start.build_lock import release_abandoned_build_lock
from tests.harness import REPO
from tests.test_arguments import build_cpu_adam_without_compiler

CHECK = """
import json, sys
from parts.fast_start import PART
from training.flags import TrainArguments
from training.parts import Launch
from training.strategy import Strategy
PART.at_start(Launch(TrainArguments(), Strategy.DEEPSPEED, 1, True))
import importlib
import cpuinfo
from deepspeed.ops.op_builder import CPUAdamBuilder
from deepspeed.runtime.zero.muon.original_muon import MuonWithAuxAdam
print(json.dumps({"muon": MuonWithAuxAdam.__module__, "shm": importlib.import_module("deepspeed.comm.torch").build_shm_op() is None,
                  "cpuinfo_cached": hasattr(cpuinfo.get_cpu_info, "cache_info"), "debug": "-g" in CPUAdamBuilder().cxx_args()}))
"""


def test_deepspeeds_unused_start_up_work_is_skipped() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = json.loads(result.stdout.strip().splitlines()[-1])
    assert skipped == {"muon": "parts.fast_start.deepspeed", "shm": True, "cpuinfo_cached": True, "debug": False}


def test_the_lock_of_a_build_killed_while_it_held_it_is_removed(tmp_path) -> None:
    """torch would wait on that file forever: the build goes on (and fails here, as it has no compiler)."""
    (tmp_path / "ops" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "ops" / "cpu_adam" / "lock").touch()
    result = build_cpu_adam_without_compiler(tmp_path)
    assert "warning: removed " in result.stderr and "left by a build of cpu_adam killed while it held it" in result.stderr
    assert "StrategyError: DeepSpeed's CPU Adam" in result.stdout, result.stdout + result.stderr[-3000:]


@pytest.mark.quick
def test_a_build_lock_still_held_is_kept_and_released_once_its_holder_is_gone(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); "
                               "print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()  # the lock is created and open
        assert not release_abandoned_build_lock("cpu_adam") and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert release_abandoned_build_lock("cpu_adam") and not lock.exists()
    assert not release_abandoned_build_lock("cpu_adam")  # nothing left to remove
