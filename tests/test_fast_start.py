"""parts/fast_start: each piece of DeepSpeed's start-up work it skips is skipped, in a fresh interpreter as a rank
starts (every DeepSpeed run of the suite then trains with them: tests/test_parity.py and the rest)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

CHECK = """
import json, sys
from parts.fast_start import at_start
from training.strategy import Strategy
at_start(Strategy.DEEPSPEED, True)
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
