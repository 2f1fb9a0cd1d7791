"""Preflight before training, and a collective that timed out turned into one clear error (exit 4)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import gather_object

from training.collectives import cpu_group
from training.errors import CollectiveTimeoutError

PREFLIGHT_TIMEOUT_S = 120
# How a timed-out collective reads: gloo says "timed out"; NCCL's watchdog "Watchdog caught collective
# operation timeout"; under TORCH_NCCL_ASYNC_ERROR_HANDLING=2 the next NCCL call "communicator was aborted".
TIMEOUT_MESSAGES = ("timed out", "timeout", "communicator was aborted")


def preflight(accelerator: Accelerator, ddp_timeout: int) -> str:
    """Prove every rank reaches every other before training; return the host/rank/device map.

    gloo's monitored barrier names any rank that does not answer within the preflight
    timeout; then one all-reduce on the training backend proves the transport training
    uses. (Setting up that transport, e.g. NCCL's communicator, is bounded by --ddp_timeout.)
    """
    timeout = timedelta(seconds=min(PREFLIGHT_TIMEOUT_S, ddp_timeout))
    me = (
        f"  rank {accelerator.process_index:>3}  local {accelerator.local_process_index:>2}  "
        f"host {socket.gethostname()}  device {accelerator.device}"
    )
    if accelerator.num_processes == 1:
        return "preflight: 1 process\n" + me
    try:
        dist.monitored_barrier(group=cpu_group(ddp_timeout), timeout=timeout, wait_all_ranks=True)
        ones = torch.ones(1, device=accelerator.device)
        dist.all_reduce(ones, async_op=True).wait(timeout=timeout)
        total = int(ones.item())
    except RuntimeError as error:
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CollectiveTimeoutError(
            f"preflight: rank {accelerator.process_index} could not complete a collective with the other ranks "
            f"({detail}); check that every node started, --main_process_ip/--main_process_port, firewalls, and "
            f"NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME on multi-node runs{loopback_hint()}"
        ) from None
    if total != accelerator.num_processes:
        raise CollectiveTimeoutError(f"preflight: an all-reduce of ones over {accelerator.num_processes} ranks gave {total}")
    return f"preflight: all-reduce over {accelerator.num_processes} processes OK\n" + "\n".join(gather_object([me]))


def loopback_hint() -> str:
    """Why other nodes may not reach this one: without GLOO_SOCKET_IFNAME, gloo advertises the
    address its host name resolves to, which some distributions map to 127.0.1.1 in /etc/hosts."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return ""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return f"; this host's name {host} does not resolve: set GLOO_SOCKET_IFNAME to the interface the nodes share"
    if address.startswith("127."):
        return (f"; this host's name {host} resolves to {address}, a loopback address the other nodes cannot reach: "
                "set GLOO_SOCKET_IFNAME to the interface the nodes share (e.g. ib0, eth0)")
    return ""


def nccl_timeouts_raise(environment: dict[str, str] = os.environ) -> None:
    """Have NCCL's watchdog abort a timed-out collective's communicators without killing the process
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, "CleanUpOnly"), so that the wait raises in Python and the run
    ends with exit 4 and its one error line, as on gloo. Set before the process group starts; set
    outright, since torchrun exports 1 (tear down: SIGABRT, exit -6) to every rank it starts.
    torch's heartbeat monitor still ends a process that stays stuck (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)."""
    environment["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"


@contextmanager
def collective_timeouts_reported(accelerator: Accelerator, ddp_timeout: int, current_step: Callable[[], int]) -> Iterator[None]:
    """Turn a collective that timed out into one `CollectiveTimeoutError` naming the step and rank.

    gloo raises on every rank still waiting once `ddp_timeout` has passed; so does NCCL once
    `nccl_timeouts_raise` has set its error handling (its watchdog aborts the communicators and
    the next call on them raises).
    """
    try:
        yield
    except RuntimeError as error:  # torch.distributed.DistBackendError is one
        if not any(message in str(error).lower() for message in TIMEOUT_MESSAGES):
            raise
        raise CollectiveTimeoutError(
            f"rank {accelerator.process_index} waited more than --ddp_timeout {ddp_timeout}s for the other ranks "
            f"at step {current_step()}: a rank stalled or died. Check the other ranks' logs; raise --ddp_timeout "
            "if a step (or a save) legitimately takes that long"
        ) from None
