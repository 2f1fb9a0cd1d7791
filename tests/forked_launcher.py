"""`accelerate launch`, run by the suite in a fork of a process that has imported it already.

Most of the suite's time is processes starting: about 100 launches, each a launcher that imports
torch and accelerate (2 CPU-s here) before it starts the ranks. A forkserver (Python's
`multiprocessing`, one per pytest worker) imports accelerate's launch command once; each launch is
a fork of it that runs that command's own `main` with the launch's arguments, environment and
working directory, so the launcher's code, and everything after it, is what `accelerate launch`
runs: the ranks are new interpreters that it starts, as always. The launcher as a command of its
own (signals sent to it, the SLURM node script, the README's `accelerate launch`) is tested with
`subprocess`: tests/conftest.py `start`, tests/test_preemption.py, tests/test_readme.py.
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


def run_launch_command(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """In the fork: accelerate's `launch` command with `argv`, output to the files `stdout` and `stderr`."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for descriptor, path in ((1, stdout), (2, stderr)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, descriptor)
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


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`accelerate launch <argv>` under `env` in `cwd`, waited for, as `subprocess.run(capture_output=True, text=True)`
    gives it. On a timeout the launcher and everything it started are killed, and `subprocess.TimeoutExpired` raised."""
    command = ["accelerate", "launch", *argv]
    with tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        stdout, stderr = Path(scratch, "stdout"), Path(scratch, "stderr")
        launcher = _FORKSERVER.Process(target=run_launch_command, args=(argv, env, str(cwd), str(stdout), str(stderr)))
        launcher.start()
        launcher.join(timeout)
        if launcher.exitcode is None:
            kill_tree(launcher.pid)
            launcher.join()
            raise subprocess.TimeoutExpired(command, timeout)
        return subprocess.CompletedProcess(command, launcher.exitcode, stdout.read_text(errors="replace"),
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
