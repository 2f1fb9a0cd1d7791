"""A rank that stalls does not hang the others forever: they abort after --ddp_timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

from tests.conftest import REPO, TINY_RUN, launch_command

DDP_TIMEOUT = 10


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"rank {rank} not found")


def test_a_stalled_rank_makes_the_others_abort_with_the_step_and_rank(tmp_path) -> None:
    command, env = launch_command(
        "ddp", "train.py", *TINY_RUN, "--output_dir", str(tmp_path), "--max_steps", "100000", "--logging_steps", "1",
        "--eval_steps", "100000", "--save_steps", "100000", "--ddp_timeout", str(DDP_TIMEOUT),
    )
    log = tmp_path / "launch.log"
    with log.open("w") as stream:
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=stream, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    stalled = None
    try:
        metrics = tmp_path / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and '"loss"' in metrics.read_text(), 120, "training to start")
        stalled = rank_process(launcher, rank=1)
        stalled.suspend()  # SIGSTOP: rank 1 stops answering mid-training, as a hung GPU or node would
        stopped_at = time.monotonic()
        wait_for(lambda: "error: rank 0 waited more than" in log.read_text(), DDP_TIMEOUT + 60, "rank 0 to abort")
        assert time.monotonic() - stopped_at >= DDP_TIMEOUT - 1  # it waited the configured timeout, not less
        stalled.resume()
        assert launcher.wait(timeout=120) != 0
    finally:
        if stalled is not None and stalled.is_running():
            stalled.kill()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    error = next(line for line in log.read_text().splitlines() if line.startswith("error: rank 0"))
    assert f"--ddp_timeout {DDP_TIMEOUT}s" in error and "at step" in error
