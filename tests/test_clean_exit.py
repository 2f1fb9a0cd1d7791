"""A finished rank exits 0, never with gloo's abort at interpreter teardown (training/process_exit.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.harness import REPO, TINY_RUN, free_port, launch

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

# A process group still referenced at exit (as DeepSpeed and DDP leave them) with a collective
# just finished: ending through the interpreter's teardown aborts about a third of such exits.
HELD_GROUP = """
import sys, torch, torch.distributed as dist
from training.process_exit import exit_process
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=int(sys.argv[1]), world_size=2)
held = dist.group.WORLD
gathered = [torch.zeros(4) for _ in range(2)]
dist.all_gather(gathered, torch.ones(4))
dist.destroy_process_group()
exit_process(int(sum(t.sum() for t in gathered)))  # 8: both ranks' ones arrived
"""


@pytest.mark.quick
def test_exit_runs_python_shutdown_but_skips_interpreter_teardown() -> None:
    script = textwrap.dedent("""
        import atexit, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from training.process_exit import exit_process

        class Teardown:
            def __del__(self):
                print("teardown ran", flush=True)

        sentinel = Teardown()  # a module global: collected only by the interpreter's teardown
        atexit.register(lambda: print("last words, not flushed by hand"))  # runs last: atexit is LIFO
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
        idle_pool = ThreadPoolExecutor(2)  # as torch.compile leaves them: workers stop only on threading's hooks
        idle_pool.submit(time.sleep, 0).result()
        exit_process(75)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 75, done.stderr
    assert done.stdout.splitlines() == ["thread finished", "atexit ran", "last words, not flushed by hand"]
    assert "teardown ran" not in done.stdout


def test_held_process_group_with_a_last_collective_exits_cleanly() -> None:
    for _ in range(3):
        port = str(free_port())
        ranks = [subprocess.Popen([sys.executable, "-c", HELD_GROUP, str(rank), port], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
        for rank in ranks:
            output, _ = rank.communicate(timeout=120)
            assert rank.returncode == 8, output
            assert "terminate called" not in output


def test_every_rank_of_a_finished_run_ends_with_nothing_left_running(tmp_path) -> None:
    out_dir = tmp_path / "exits"
    out_dir.mkdir()
    result = launch("deepspeed_zero3", "tests/probes/exit_probe.py", str(out_dir), *TINY_RUN,
                    "--output_dir", str(tmp_path / "run"), "--max_steps", "3", "--block_size", "64")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "===== training summary =====" in result.stdout  # rank 0's output, flushed before os._exit
    records = [json.loads((out_dir / f"rank_{rank}.json").read_text()) for rank in (0, 1)]
    for record in records:
        assert record["code"] == 0
        assert record["non_daemon_threads"] == []
        assert record["process_group_initialized"] is False
    # DeepSpeed still holds its groups, so gloo's threads outlive destroy_process_group: the
    # reason a rank must not end through the interpreter's teardown. If this ever fails, the
    # libraries release their groups and training/process_exit.py may be unnecessary.
    assert all(record["gloo_threads_alive"] for record in records)


def test_an_unexpected_exception_prints_its_traceback_and_leaves_through_the_same_clean_exit(tmp_path) -> None:
    """Not one of the documented failures (a ZeRO-2 checkpoint resumed under fsdp.yaml raised an AssertionError
    in torch's checkpoint reader): it left through the interpreter's teardown, and gloo aborted rank 0 (-6)."""
    out_dir = tmp_path / "exits"
    out_dir.mkdir()
    result = launch("ddp", "tests/probes/exit_probe.py", str(out_dir), *TINY_RUN, "--output_dir", str(tmp_path / "run"),
                    "--max_steps", "3", "--block_size", "64", env={"EXIT_PROBE_FAILING_STEP": "1"})
    assert result.returncode == 1, result.stderr[-4000:]
    assert "Traceback" in result.stderr and "AssertionError: an error train.py does not document" in result.stderr
    assert "terminate called" not in result.stdout + result.stderr
    for rank in (0, 1):  # each rank ended through exit_process with exit 1, its process group closed
        record = json.loads((out_dir / f"rank_{rank}.json").read_text())
        assert record["code"] == 1 and record["non_daemon_threads"] == [], record


@pytest.mark.quick
def test_each_documented_end_has_its_exit_code_from_one_home() -> None:
    """training/errors.py: the exit code and line of every error train.py reports in one line; a missing file is
    bad input; anything else is not a documented end (its traceback, exit 1)."""
    from training import errors

    codes = {error.__name__: (error.exit_code, error.prefix, error.every_rank) for error in (
        errors.ArgumentError, errors.DataError, errors.ModelError, errors.StrategyError, errors.ResumeError,
        errors.NonFiniteLossError, errors.CollectiveTimeoutError, errors.PeerEnded, errors.Preempted)}
    assert codes == {"ArgumentError": (2, "error", False), "DataError": (2, "error", False),
                     "ModelError": (2, "error", False), "StrategyError": (2, "error", False),
                     "ResumeError": (2, "error", False),
                     "NonFiniteLossError": (3, "error", False), "CollectiveTimeoutError": (4, "error", True),
                     "PeerEnded": (4, "error", False), "Preempted": (75, "stopped", False)}
    missing = errors.ending(FileNotFoundError(2, "No such file or directory", "/nonexistent"))
    assert (missing.exit_code, str(missing)) == (2, "[Errno 2] No such file or directory: '/nonexistent'")
    assert errors.ending(KeyError("a bug")) is None and errors.ending(ValueError("a bug")) is None
    # gloo's words for a collective whose peer has exited (the launches of test_bad_input meet it: a JSON Lines
    # file only the main process reads first, a tampered ZeRO shard only rank 0 loads)
    lost = errors.ending(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:53410"))
    assert isinstance(lost, errors.PeerEnded) and lost.exit_code == 4
    assert errors.ending(RuntimeError("a bug")) is None
