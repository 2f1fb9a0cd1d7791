"""The suite's ranks, forked from a launcher that imported the libraries (tests/forked_launcher.py), start as
the new interpreters that `accelerate launch` starts would: only the libraries' import is skipped."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, launch, launch_command

PROBE = "tests/probes/start_probe.py"
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}  # a free port and a temporary directory, each launch its own


def ranks(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stderr[-3000:]
    return sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                  key=lambda rank: int(rank["environment"].get("RANK", 0)))


@pytest.mark.parametrize("config", ["single", "ddp"])  # accelerate's own launcher, and torch's elastic agent
def test_a_forked_rank_starts_as_a_new_interpreter_would(config) -> None:
    forked = ranks(launch(config, PROBE, "--some_flag", "value"))
    command, env = launch_command(config, PROBE, "--some_flag", "value")
    new = ranks(subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300))
    assert len(forked) == len(new) == (1 if config == "single" else 2)
    assert all(rank.pop("libraries_imported") for rank in forked) and not any(rank.pop("libraries_imported") for rank in new)
    for forked_rank, new_rank in zip(forked, new):
        for rank in (forked_rank, new_rank):
            for key in PER_LAUNCH & rank["environment"].keys():
                rank["environment"][key] = "<per launch>"
        assert forked_rank == new_rank  # modules, threads, environment, signals, descriptors, argv, session, stdout
