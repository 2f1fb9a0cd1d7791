"""Two machines x one process on one host over loopback, launched as a real multi-node run would be."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess

import pytest

from tests.harness import (
    REPO,
    SPLIT_OF,
    TINY_RUN,
    free_port,
    launch_command,
    logged_after,
    node_script_command,
    split_run_args,
    wait_for,
)
from training.parts import installed

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


def machine_command(how: str, config: str, machine_rank: int, port: int, args: tuple[str, ...]):
    """`accelerate launch` with accelerate's machine flags (static rendezvous), or the SLURM node script (c10d)."""
    if how == "machine flags":
        return launch_command(config, "train.py", *args, launcher_args=(
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine_rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)))
    return node_script_command(config, *args, nnodes=2, node_rank=machine_rank, procs_per_node=1, port=port)


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize(("config", "how", "data"), [("ddp", "machine flags", "files"),
                                                     ("fsdp", "SLURM node script", "files"),
                                                     pytest.param("ddp", "machine flags", "prepared shards",
                                                                  marks=pytest.mark.parts("pretokenized"))])
def test_two_machines_train_together(config, how, data, split_run, uneven_data, cached_run, request, tmp_path) -> None:
    """Data files that each machine reads, or the shards that scripts/prepare_data.py wrote once, shared by both."""
    if data == "files":  # the same 2 processes on one machine: test_accumulation.py's run, or test_streaming.py's
        args, one_machine = split_run_args(uneven_data, SPLIT_OF[config]), split_run(SPLIT_OF[config])
    else:
        from tests.fixtures.pretokenized import shards_run_args

        args = shards_run_args(request.getfixturevalue("prepared_shards"))  # the pretokenized part's script
        one_machine = cached_run(config, *args)
    port, machines = free_port(), []
    try:
        for machine_rank in (0, 1):
            command, env = machine_command(how, config, machine_rank, port, (*TINY_RUN, "--output_dir", str(tmp_path), *args))
            with (tmp_path / f"machine{machine_rank}.log").open("w") as log:
                machines.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 start_new_session=True))
            if machine_rank == 0:  # machine 0 hosts the rendezvous: let it claim the port first
                wait_for(lambda: port_open(port), 120, "machine 0 to listen")
        codes = [machine.wait(timeout=300) for machine in machines]
    finally:  # each launcher and its ranks
        for machine in machines:
            if machine.poll() is None:
                os.killpg(machine.pid, signal.SIGKILL)
    logs = [(tmp_path / f"machine{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert f"strategy={config}" in logs[0] and "processes=2" in logs[0]
    if installed("hangs"):  # the preflight's map: one process on each machine, each its machine's local rank 0
        assert "preflight: all-reduce over 2 processes OK" in logs[0]
        assert re.search(r"rank +0 +local +0", logs[0]) and re.search(r"rank +1 +local +0", logs[0]), logs[0][-3000:]
    expected, actual = logged_after(one_machine, 0), logged_after(tmp_path, 0)
    assert actual.keys() == expected.keys()
    for entry in expected:  # trained together: the same global batches, so the same losses
        assert actual[entry] == pytest.approx(expected[entry], rel=1e-6, abs=1e-7), entry
