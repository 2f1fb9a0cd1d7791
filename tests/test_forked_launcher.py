"""The suite's ranks, forked from a launcher that imported the libraries (tests/forked_launcher.py), start as
the new interpreters that `accelerate launch` starts would: only the libraries' import is skipped."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO, launch, launch_command

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
    assert [comparable(rank) for rank in forked_ranks] == [comparable(rank) for rank in new_ranks]


def test_a_launch_whose_environment_the_libraries_would_read_gets_new_interpreters(monkeypatch) -> None:
    """HF_HUB_OFFLINE is read as huggingface_hub is imported: the ranks import it themselves. (Set to the value
    the caller's shell does not have: an offline cluster's shell often sets it, and the forkserver inherits it.)"""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1")
    result = launch("ddp", PROBE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [rank["libraries_imported"] for rank in ranks(result)] == [False, False]
