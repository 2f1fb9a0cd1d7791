"""Owns what the ranks say to each other outside the model: one gather of scalars per logging step, a CPU group for
host-side agreements, and the end of the process groups."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator

from training.errors import CollectiveTimeoutError


def start_restarted_process_group(backend: str, timeout: timedelta) -> None:
    """A round of workers that torchrun restarted (`--max_restarts`) starts its process group under keys of its own.
    torch 2.13's c10d rendezvous keeps one TCP store across restarts, and the default group's keys name no attempt,
    so restarted ranks read the dead round's gloo addresses ("Gloo connectFullMesh failed ... Connection refused").
    accelerate then uses this group as it finds it."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or dist.is_initialized():
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timeout)


@contextmanager
def joining_process_group(timeout: timedelta) -> Iterator[None]:
    """Starting the process group: ranks that do not all arrive within --ddp_timeout end it with one line (exit 4),
    where torch would print its store's traceback. A restarted round (`--max_restarts`) waits on ranks that died
    again or never restarted: on several machines, only c10d rendezvous restarts every machine's workers."""
    try:
        yield
    except (dist.DistStoreError, dist.DistNetworkError) as error:  # the others never came; the store's host neither
        store = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        raise CollectiveTimeoutError(
            f"rank {os.environ.get('RANK', '0')} waited more than --ddp_timeout {int(timeout.total_seconds())}s for "
            f"all {os.environ.get('WORLD_SIZE', '1')} ranks to start the process group (store {store}"
            f"{f', torchrun restart {attempt}' if attempt else ''}): a rank died or never started; check the other "
            "ranks' logs, and restart a job of several machines with c10d rendezvous (--rdzv_backend c10d, as "
            "scripts/slurm/launch_node.sh does)"
        ) from error


@functools.cache
def cpu_group(timeout_s: int) -> dist.ProcessGroup | None:
    """A gloo group over all ranks, for host-side agreements that must not wait on the GPU: on CPU None, the default
    group (a reference would keep it alive past `destroy_process_group`: abort at exit); on GPUs one more group, made
    by the first call on every rank (gloo picks its interface from the host name: set GLOO_SOCKET_IFNAME)."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def gather_scalars(accelerator: Accelerator, values: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
    """Every rank's value of each named scalar (CPU float64, one per rank) in one collective and one wait for the
    device, however many figures a step reports; values may be device tensors, DTensors or numbers."""
    local = [value.full_tensor() if hasattr(value, "full_tensor") else value for value in values.values()]
    row = torch.stack([torch.as_tensor(value, device=accelerator.device).detach().to(torch.float64).reshape(())
                       for value in local])
    everyone = accelerator.gather(row.unsqueeze(0)).cpu()  # (ranks, values)
    return {name: everyone[:, column] for column, name in enumerate(values)}


def end_collectives(accelerator: Accelerator) -> None:
    """Finish the trackers and destroy every process group, on every rank, and drop our reference to the CPU group
    (gloo stops a group's threads only once nothing refers to it; libraries keep theirs: training/process_exit.py)."""
    accelerator.end_training()
    cpu_group.cache_clear()


def max_over_ranks(values: dict[str, int], accelerator: Accelerator) -> dict[str, int]:
    """Each value's largest over the ranks (a collective, unless nothing was measured: the same on every rank)."""
    return {key: int(column.max()) for key, column in gather_scalars(accelerator, values).items()} if values else {}
