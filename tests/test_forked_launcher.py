"""The suite's ranks, forked from a launcher that imported the libraries (tests/forked_launcher.py), start as
the new interpreters that `accelerate launch` starts would: only the libraries' import is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import forked_launcher
from tests.harness import REPO, launch, launch_command

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

PROBE = "tests/probes/start_probe.py"
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}  # a free port and a temporary directory, each launch its own
IMPORT_THREADS = {"jemalloc_bg_thd"}  # pyarrow's allocator starts it as it loads: a fork has only the forking thread


def ranks(result: subprocess.CompletedProcess) -> list[dict]:
    return sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                  key=lambda rank: int(rank["environment"].get("RANK", 0)))


def comparable(rank: dict) -> dict:
    """What must be equal between a forked rank and a new interpreter in the same place."""
    rank["environment"] |= {key: "<per launch>" for key in PER_LAUNCH & rank["environment"].keys()}
    rank["native_threads"] = sorted(set(rank["native_threads"]) - IMPORT_THREADS)
    return {key: value for key, value in rank.items() if key not in {"libraries_imported", "numpy_draw"}}


@pytest.mark.parametrize("config", ["single", "ddp"])  # accelerate's own launcher, and torch's elastic agent
def test_a_forked_rank_starts_as_a_new_interpreter_would(config) -> None:
    """Modules, threads, environment, signal handlers and mask, descriptors, streams, argv, __file__, sys.path,
    session, multiprocessing's view, atexit; the last rank exits 3, which the launcher reports alike."""
    forked = launch(config, PROBE, "--exit_code", "3")
    command, env = launch_command(config, PROBE, "--exit_code", "3")
    new = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert forked.returncode == new.returncode == 1
    reported = "exit status 3" if config == "single" else "exitcode  : 3"
    assert reported in forked.stderr and reported in new.stderr, forked.stderr[-3000:]
    forked_ranks, new_ranks = ranks(forked), ranks(new)
    assert len(forked_ranks) == len(new_ranks) == (1 if config == "single" else 2), forked.stderr[-3000:]
    assert all(rank["libraries_imported"] for rank in forked_ranks)
    assert not any(rank["libraries_imported"] for rank in new_ranks)
    for each in (forked_ranks, new_ranks):  # each rank seeds numpy anew, as a new interpreter does
        assert len({rank["numpy_draw"] for rank in each}) == len(each)
    for forked_rank, new_rank in zip(map(comparable, forked_ranks), map(comparable, new_ranks), strict=True):
        assert forked_rank.keys() == new_rank.keys()
        for key, value in new_rank.items():  # one key at a time: the environment's difference, not a page of it
            if isinstance(value, dict):
                differing = {name for name in value.keys() | forked_rank[key].keys()
                             if value.get(name) != forked_rank[key].get(name)}
                assert not differing, {name: (forked_rank[key].get(name), value.get(name)) for name in differing}
            assert forked_rank[key] == value, key


def test_a_launch_whose_environment_the_libraries_would_read_gets_new_interpreters(monkeypatch) -> None:
    """HF_HUB_OFFLINE is read as huggingface_hub is imported: the ranks import it themselves. (Set to the value
    the caller's shell does not have: an offline cluster's shell often sets it, and the forkserver inherits it.)"""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1")
    result = launch("ddp", PROBE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [rank["libraries_imported"] for rank in ranks(result)] == [False, False]


READS_AT_IMPORT = """
import collections, json, os, sys
by_caller = collections.defaultdict(set)  # (file, line) of the read -> the names it read
get = os._Environ.__getitem__

def recording(self, key):  # os.environ[...], .get, in, os.getenv
    caller = sys._getframe(1)
    while "_collections_abc" in caller.f_code.co_filename:  # Mapping.get, a view's iteration: who called them
        caller = caller.f_back
    by_caller[caller.f_code.co_filename, caller.f_lineno].add(key)
    return get(self, key)

os._Environ.__getitem__ = recording
sys.argv = ["train.py"]
import train, accelerate.commands.launch  # what the forkserver imports (tests/preloaded_train.py)
os._Environ.__getitem__ = get
# a place that read (nearly) every variable set, and nothing else, copied the environment (fsspec and tqdm do, to
# pick their own prefixes); torch's configs read hundreds of names from one line, most of them unset
copies = [keys for keys in by_caller.values() if keys <= os.environ.keys() and len(keys) >= 0.9 * len(os.environ)]
print(json.dumps(sorted({key for keys in by_caller.values() if keys not in copies for key in keys})))
"""


def test_no_variable_a_fork_may_differ_in_is_read_as_the_libraries_are_imported() -> None:
    """The forked ranks skip the import, so a variable read then keeps the forkserver's value in them: a launch whose
    environment differs in it must get new interpreters. Re-checked at every pin: accelerate 1.15 reads
    ACCELERATE_USE_MEGATRON_LM as it is imported (no longer under the exempt ACCELERATE_USE_ prefix), and its menus
    COLUMNS and LINES. (Reads through os.environ, a whole copy of it aside; a C library's getenv is not seen.)"""
    done = subprocess.run([sys.executable, "-c", READS_AT_IMPORT], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.splitlines()[-1])
    assert len(read) > 100  # the recorder saw the libraries' reads
    assert [name for name in read if forked_launcher.read_at_run_time_only(name)] == []
