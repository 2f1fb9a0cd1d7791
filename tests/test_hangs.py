"""The part hangs: a rank that stalls does not hang the others forever: they abort after --ddp_timeout, with exit 4 and
one error line naming the rank and step, on gloo and (by its error handling) NCCL; a preflight failure names a head
node unreachable by its name."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from torch.distributed import DistBackendError

from parts.hangs.guard import collective_timeouts_reported, loopback_hint, nccl_timeouts_raise
from tests.harness import end_launch, rank_processes, start, wait_for
from training.errors import CollectiveTimeoutError

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

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
        end_launch(launcher, [stalled] if stalled is not None else [])
    error = next(line for line in log.read_text().splitlines() if line.startswith("error: rank 0"))
    assert f"--ddp_timeout {DDP_TIMEOUT}s" in error and "at step" in error


# What a timed-out collective raises: gloo's wait, NCCL's watchdog report, and the next NCCL call
# once the watchdog has aborted the communicators (TORCH_NCCL_ASYNC_ERROR_HANDLING=2).
TIMEOUT_ERRORS = [
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation",
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600012 milliseconds "
    "before timing out.",
    "NCCL communicator was aborted on rank 1.",
]


@pytest.mark.quick
@pytest.mark.parametrize("message", TIMEOUT_ERRORS)
def test_a_collective_timeout_on_gloo_or_nccl_is_the_documented_error(message) -> None:
    accelerator = SimpleNamespace(process_index=1)
    with pytest.raises(CollectiveTimeoutError, match=r"rank 1 waited more than --ddp_timeout 30s .* at step 7"):
        with collective_timeouts_reported(accelerator, 30, lambda: 7):
            raise DistBackendError(message)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):  # any other error stays itself
        with collective_timeouts_reported(accelerator, 30, lambda: 7):
            raise RuntimeError("CUDA out of memory")


@pytest.mark.quick
def test_nccl_is_told_to_raise_instead_of_killing_the_process() -> None:
    """torchrun exports TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down: SIGABRT, exit -6): replaced by 2."""
    environment = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    nccl_timeouts_raise(environment)
    assert environment == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


@pytest.mark.quick
@pytest.mark.parametrize(
    ("gloo_interface", "address", "hint"),
    [(None, "127.0.1.1", "resolves to 127.0.1.1, a loopback address the other nodes cannot reach: set GLOO_SOCKET_IFNAME"),
     (None, "10.0.0.5", ""), ("ib0", "127.0.1.1", "")],
)
def test_a_preflight_failure_names_a_host_name_that_resolves_to_loopback(monkeypatch, gloo_interface, address, hint) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    if gloo_interface:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", gloo_interface)
    monkeypatch.setattr("socket.gethostbyname", lambda host: address)
    assert hint in loopback_hint() and bool(loopback_hint()) == bool(hint)
