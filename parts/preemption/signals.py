"""Stop cleanly when the cluster asks: SIGTERM or SIGUSR1 finishes the step, saves, and exits.

Schedulers announce a kill with a signal: SLURM sends SIGTERM at preemption or the time
limit (and SIGUSR1 with `--signal=USR1@<seconds>`), then SIGKILL after a grace period.
The signal may reach the launcher, some ranks or all of them:
- `accelerate launch` on several processes (torchrun's agent) forwards SIGTERM to every
  rank, and the signals listed in `PET_SIGNALS_TO_HANDLE`, then waits
  `PET_SHUTDOWN_TIMEOUT` seconds (default 30) before it kills them;
- a launcher that dies without forwarding (one process, or a signal torchrun does not
  handle) still reaches the ranks: each asks the kernel for SIGTERM when its parent dies.
Ranks may see the signal at different steps, or only one rank may see it, so every few
optimizer steps (`StopRequests.AGREE_EVERY`) they agree with a one-number all-reduce on a CPU
(gloo) group, which never waits for the GPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys
from types import FrameType

# torch is imported where it is used: train.py installs the handlers before the libraries
# load (seconds), so that a SIGTERM then cannot kill a rank either.

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PARENT_AT_START = os.getppid()
logger = logging.getLogger(__name__)


class StopRequests:
    """Records stop signals; `agreed()` tells every rank whether any rank received one.

    Agreeing is an all-reduce over the CPU (gloo) group, a network round trip across nodes:
    it runs every AGREE_EVERY optimizer steps and on the steps that wait for the other ranks
    anyway (logging, evaluation, saving, an epoch's end). So a stop takes up to AGREE_EVERY
    steps and a save: the scheduler's warning (`--signal=B:USR1@300`) or grace period must
    hold that. A single process stops after the step it was signalled in.
    """

    AGREE_EVERY = 5

    def __init__(self) -> None:
        self.received = 0  # the signal number, 0 for none

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum  # only a flag: the training loop decides when it is safe to stop

    def agreed(self, step: int, now: bool = False, timeout_s: int = 1800) -> str | None:
        """After optimizer step `step`: the name of a stop signal any rank received, or None
        (also between agreements). A collective on agreement steps (every AGREE_EVERY, or `now`):
        call it on every rank with the same arguments."""
        import torch
        import torch.distributed as dist

        from training.collectives import cpu_group

        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if distributed and not now and step % self.AGREE_EVERY:
            return None
        received = torch.tensor([self.received])
        if distributed:  # the CPU group is made at the first agreement, which every rank reaches
            dist.all_reduce(received, op=dist.ReduceOp.MAX, group=cpu_group(timeout_s))
        return signal.Signals(int(received)).name if received else None


@functools.cache
def install_stop_handlers() -> StopRequests:
    """From now until the process exits, SIGTERM and SIGUSR1 only set a flag (once per process).

    A signal during set-up stops the run at its first agreement (after the first step for one
    process, within AGREE_EVERY steps for several); one during the final export
    lets the export finish (within the scheduler's grace period). A second signal, as
    torchrun and SLURM both send one, changes nothing. Installed as train.py starts, so a
    rank that finds bad input still prints its error line: when the first rank exits,
    torchrun sends SIGTERM to the others, maybe while they still import the libraries.
    """
    requests = StopRequests()
    for sig in STOP_SIGNALS:
        signal.signal(sig, requests.handle)
    _sigterm_when_parent_dies(requests)
    return requests


def _sigterm_when_parent_dies(requests: StopRequests) -> None:
    """Ask Linux to send SIGTERM if the launcher dies, so a killed launcher still means 'save and stop'."""
    if not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        logger.warning("could not ask for SIGTERM on the launcher's death; kill the ranks directly to stop them")
    if os.getppid() != _PARENT_AT_START:  # the launcher was already gone before we asked
        requests.received = signal.SIGTERM


def leave_stop_signals_to_the_rank(_worker_id: int) -> None:
    """A data loader worker's `worker_init_fn`: ignore stop signals. torchrun signals each rank's whole process
    group, its loader workers too, and a worker that died of SIGTERM would crash the rank before it saves; the
    rank stops them itself once it has."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def end_loader_workers_at_exit() -> None:
    """End this rank's loader workers with SIGKILL when it exits: they ignore SIGTERM (above), which multiprocessing's
    own exit hook sends them before it waits for them to end. Registered after that hook, so it runs before it."""
    import atexit
    import multiprocessing

    atexit.register(lambda: [child.kill() for child in multiprocessing.active_children()])
