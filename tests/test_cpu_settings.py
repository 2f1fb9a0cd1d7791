"""The part parts/cpu_settings: each process's share of the cores, and freed memory kept (real launches and a
real allocator)."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from parts.cpu_settings.settings import MALLOC_SETTINGS
from tests.harness import REPO


@pytest.mark.parametrize(("config", "processes"), [("single", 1), ("ddp", 2)])
def test_each_process_computes_on_its_share_of_the_cores_unless_the_user_chose(config, processes, strategy_run,
                                                                                 base_model) -> None:
    """The parity runs are fresh `accelerate launch train.py` runs (new interpreters, the user's environment, no
    OMP_NUM_THREADS): accelerate gives each process OMP_NUM_THREADS=1 by default, and the README's default job
    used one of two cores (1.73x slower). The suite's other launches export OMP_NUM_THREADS=1, as a user may."""
    share = max(1, len(os.sched_getaffinity(0)) // processes)
    expected = f"{share} CPU thread{'s' if share > 1 else ''} per process"
    started = [line for line in (strategy_run(config) / "launch.log").read_text().splitlines() if "per process" in line]
    assert len(started) == 1 and started[0].endswith(f" {expected}"), started  # the rank's own count, logged once
    chosen = [line for line in (base_model.parent / "launch.log").read_text().splitlines() if "per process" in line]
    assert len(chosen) == 1 and chosen[0].endswith(" 1 CPU thread per process (as set)"), chosen


def glibc_with_small_pages() -> bool:
    """glibc's malloc, and transparent huge pages not on for every heap (they fault it in 2 MiB at a time)."""
    huge_pages = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return platform.libc_ver()[0] == "glibc" and not (huge_pages.exists() and "[always]" in huge_pages.read_text())


# A step: activations allocated layer by layer (8 blocks of 4 MiB), all freed by the backward; the minor page
# faults of each step's allocations, over 6 steps
STEPS = """
import json, resource, sys, torch
import accelerate  # as in train.py, whose heap holds the libraries before the part runs
from parts.cpu_settings.settings import keep_freed_memory
if sys.argv[1] == "kept":
    keep_freed_memory()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(2**20) for _ in range(8)]
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del blocks
print(json.dumps(faults))
"""


@pytest.mark.quick
@pytest.mark.skipif(not glibc_with_small_pages(), reason="needs glibc's malloc on 4 KiB pages")
def test_memory_freed_by_a_step_is_reused_by_the_next_instead_of_faulted_in_again() -> None:
    """glibc's default gives the freed 32 MiB back to the OS and faults it in again at the next step (in most
    processes here at every step, as train.py's steps did, 8,000 pages each); kept (what train.py sets on CPU),
    the steps reuse it from the third on."""
    faults = {}
    for how in ("glibc default", "kept"):
        environment = {name: value for name, value in os.environ.items() if name not in MALLOC_SETTINGS}
        probe = subprocess.run([sys.executable, "-c", STEPS, how], cwd=REPO, capture_output=True, text=True,
                               timeout=120, env=environment | {"PYTHONPATH": str(REPO)})
        assert probe.returncode == 0, probe.stderr[-2000:]
        faults[how] = json.loads(probe.stdout)
    pages = 32 * 2**20 // resource.getpagesize()
    assert sum(faults["glibc default"][1:]) > pages * 0.9, faults  # what the accommodation removes
    assert sum(faults["kept"][1:]) < pages / 4 and max(faults["kept"][3:]) < pages / 100, faults
