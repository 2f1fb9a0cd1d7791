"""`accelerate launch`, run by the suite in a fork of a process that has imported it already.

Most of the suite's time is processes starting: about 100 launches, each a launcher that imports
torch and accelerate (2 CPU-s here) before it starts the ranks. A forkserver (Python's
`multiprocessing`, one per pytest worker) imports accelerate's launch command once; each launch is
a fork of it that runs that command's own `main` with the launch's arguments, environment and
working directory, so the launcher's code, and everything after it, is what `accelerate launch`
runs: the ranks are new interpreters that it starts, as always, and a signal sent to the launcher
reaches that code as it would reach the command (tests/test_preemption.py). A launcher that is a
command of its own runs where the command is what is tested: the SLURM node script, which calls
`accelerate launch` (tests/test_preemption.py, tests/test_multinode.py), the machine flags of
several nodes (tests/test_multinode.py), and the launches under an address-space limit
(tests/test_batch_size.py).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["accelerate.commands.launch", __name__])


def run_launch_command(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str,
                       new_session: bool = False) -> None:
    """In the fork: accelerate's `launch` command with `argv`, output to the files `stdout` and `stderr` (one
    file for both if they are the same path); `new_session`: as the leader of a session of its own."""
    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    opened = {path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for path in {stdout, stderr}}
    os.dup2(opened[stdout], 1)
    os.dup2(opened[stderr], 2)
    for file in opened.values():
        os.close(file)
    sys.argv = ["accelerate launch", *argv]
    from accelerate.commands.launch import main

    code = 0
    try:
        main()
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
    except BaseException:  # as the command would: the traceback, and exit 1
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the fork's copy of the forkserver's state is not torn down


class Launcher:
    """What the tests use of `subprocess.Popen`, for a launcher started by `start`."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._process, self.args, self.pid = process, args, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode


def start(argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path | None = None,
          new_session: bool = True) -> Launcher:
    """`accelerate launch <argv>` started, not waited for: by default in a session of its own (as
    `Popen(start_new_session=True)`) with both output streams to `stdout`."""
    process = _FORKSERVER.Process(target=run_launch_command,
                                  args=(argv, env, str(cwd), str(stdout), str(stderr or stdout), new_session))
    process.start()
    return Launcher(process, ["accelerate", "launch", *argv])


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`accelerate launch <argv>` under `env` in `cwd`, waited for, as `subprocess.run(capture_output=True, text=True)`
    gives it. On a timeout the launcher and everything it started are killed, and `subprocess.TimeoutExpired` raised."""
    with tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        stdout, stderr = Path(scratch, "stdout"), Path(scratch, "stderr")
        launcher = start(argv, env, cwd, stdout, stderr, new_session=False)
        try:
            code = launcher.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(launcher.pid)
            launcher.wait()
            raise
        return subprocess.CompletedProcess(launcher.args, code, stdout.read_text(errors="replace"),
                                           stderr.read_text(errors="replace"))


def kill_tree(pid: int) -> None:
    """Kill a process and everything under it."""
    try:
        root = psutil.Process(pid)
        processes = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
