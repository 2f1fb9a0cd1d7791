"""A rank that stalls does not hang the others forever: they abort after --ddp_timeout."""

from __future__ import annotations

import os
import signal
import time

from tests.conftest import rank_processes, start, wait_for

DDP_TIMEOUT = 10


def test_a_stalled_rank_makes_the_others_abort_with_the_step_and_rank(tmp_path) -> None:
    launcher = start("ddp", tmp_path, "--max_steps", "100000", "--logging_steps", "1", "--eval_steps", "100000",
                     "--save_steps", "100000", "--ddp_timeout", str(DDP_TIMEOUT))
    log, stalled = tmp_path / "launch.log", None
    try:
        metrics = tmp_path / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and '"loss"' in metrics.read_text(), 120, "training to start")
        stalled = rank_processes(launcher)[1]
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
