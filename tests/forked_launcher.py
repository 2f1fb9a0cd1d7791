"""`accelerate launch`, run by the suite in forks of processes that have imported what it runs.

Most of the suite's time is processes starting: about 130 launches, each a launcher that imports
torch and accelerate (2 CPU-s here) and ranks that import train.py's libraries (3 of the 4 CPU-s a
tiny run's rank takes). So:
- the launcher: a forkserver (Python's `multiprocessing`, one per pytest worker) imports accelerate's
  launch command and train.py's libraries once (tests/preloaded_train.py); each launch is a fork of
  it that runs that command's own `main` with the launch's arguments, environment and working
  directory, so the launcher's code is what `accelerate launch` runs, and a signal sent to it
  reaches that code as it would reach the command (tests/test_preemption.py);
- the ranks of a launch that `run` waits for: the launcher's `Popen` of `python -u train.py ...`
  (accelerate's for one process, torch's elastic agent's for several) becomes a fork of the launcher
  that runs the script as `__main__` with that command's arguments, environment, output and session:
  the template's own modules imported afresh, a new interpreter's signal defaults, no descriptor of
  the launcher's. Each rank is a process of its own, with its process group on gloo; what it skips
  is importing the libraries again.

New interpreters remain where a fork could differ from one: ranks whose environment differs from
the one the libraries were imported under in a variable that a library reads as it is imported
(`HF_HOME`, `HF_HUB_OFFLINE`), commands other than a Python script, and every launch that `start`
makes: the tests that signal, freeze or find the ranks by their command line (tests/test_preemption.py,
tests/test_hangs.py, tests/test_streaming.py), where the stop handlers must be installed before any
library loads. Commands of their own run where the command is what is tested: the SLURM node script
(tests/test_preemption.py, tests/test_multinode.py), the machine flags of several nodes
(tests/test_multinode.py), the launches under an address-space limit (tests/test_batch_size.py) and
scripts/benchmark.py (tests/test_benchmark.py).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
# What every suite launch adds to the pytest worker's environment (tests/conftest.py).
SUITE_LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["tests.preloaded_train", "accelerate.commands.launch"])  # in this order
# Environment variables that no library reads as it is imported, only as a rank runs: what accelerate's launcher
# and torch's elastic agent set for each rank, DeepSpeed's CUDA check (set by importing it, in a test too), and
# what pytest sets (the current test's name; the terminal size that GNU readline, imported by pytest's debugger
# support, writes into the C environment, which the forkserver inherits). Checked in accelerate 1.15, torch 2.13.
_READ_AT_RUN_TIME = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "TORCHELASTIC_", "MASTER_ADDR", "MASTER_PORT",
                     "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "KMP_", "PYTHONPATH",
                     "PYTORCH_NVML_BASED_CUDA_CHECK", "PYTEST_CURRENT_TEST", "COLUMNS", "LINES")
_POPEN = subprocess.Popen


def run_launch_command(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str,
                       new_session: bool = False, fork_ranks: bool = False) -> None:
    """In the fork: accelerate's `launch` command with `argv`, output to the files `stdout` and `stderr` (one
    file for both if they are the same path); `new_session`: as the leader of a session of its own;
    `fork_ranks`: its ranks forked from this process where they can be (the module's docstring)."""
    if new_session:
        os.setsid()
    if fork_ranks:
        _fork_ranks()
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
          new_session: bool = True, fork_ranks: bool = False) -> Launcher:
    """`accelerate launch <argv>` started, not waited for: by default in a session of its own (as
    `Popen(start_new_session=True)`) with both output streams to `stdout`, and ranks that are new interpreters."""
    process = _FORKSERVER.Process(target=run_launch_command, args=(
        argv, env, str(cwd), str(stdout), str(stderr or stdout), new_session, fork_ranks))
    process.start()
    return Launcher(process, ["accelerate", "launch", *argv])


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`accelerate launch <argv>` under `env` in `cwd`, waited for, as `subprocess.run(capture_output=True, text=True)`
    gives it. On a timeout the launcher and everything it started are killed, and `subprocess.TimeoutExpired` raised."""
    with tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        stdout, stderr = Path(scratch, "stdout"), Path(scratch, "stderr")
        launcher = start(argv, env, cwd, stdout, stderr, new_session=False, fork_ranks=True)
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


def _fork_ranks() -> None:
    """Have this launcher fork the ranks it would start as `python -u <script>.py ...`, where their environment
    differs from the one the libraries were imported under in variables read at run time alone; `Popen` as
    before for anything else."""
    preloaded = sys.modules.get("tests.preloaded_train")  # absent where its import failed: no forks then
    if preloaded is None:
        return

    def rank_process(args, env=None, stdout=None, stderr=None, start_new_session=False, **others):
        script, rank_env = _python_script(args), dict(os.environ if env is None else env)
        differing = {key for key in rank_env.keys() | preloaded.IMPORTED_UNDER.keys()
                     if rank_env.get(key) != preloaded.IMPORTED_UNDER.get(key)}
        if script is None or others or not all(key.startswith(_READ_AT_RUN_TIME) for key in differing):
            return _POPEN(args, env=env, stdout=stdout, stderr=stderr, start_new_session=start_new_session, **others)
        return ForkedRank(args, script, preloaded.SET_BY_IMPORT | rank_env, stdout, stderr, start_new_session)

    _use_popen(rank_process)  # in this launcher alone: it is a fork


def _use_popen(popen) -> None:
    """`popen` as what accelerate's launcher and torch's elastic agent call to start a rank."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    subprocess.Popen = subprocess_handler.Popen = popen


def _python_script(args) -> str | None:
    """The script of `[this python, (-u), script.py, ...]`, else None."""
    args = [str(arg) for arg in args]
    if len(args) < 2 or args[0] != sys.executable:
        return None
    script = args[2] if args[1] == "-u" and len(args) > 2 else args[1]
    return script if script.endswith(".py") and os.path.isfile(script) else None


class ForkedRank:
    """What accelerate's launcher and torch's elastic agent use of `subprocess.Popen`, for a rank that is a fork
    of the launcher running a Python script as `python -u` would."""

    def __init__(self, args, script: str, env: dict[str, str], stdout, stderr, new_session: bool) -> None:
        self.args, self.returncode = args, None
        outputs = tuple(None if stream is None else stream.fileno() for stream in (stdout, stderr))
        argv = [script, *[str(arg) for arg in args[args.index(script) + 1:]]]
        self._process = multiprocessing.get_context("fork").Process(
            target=_run_rank, args=(script, argv, env, outputs, new_session))
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():  # is_alive reaps it
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:  # not join(): its pipe stays open while the rank's own children live
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _is_template_code(path: str | None) -> bool:
    return path is not None and Path(path).is_relative_to(REPO) and not Path(path).is_relative_to(REPO / "tests") \
        and ".venv" not in Path(path).relative_to(REPO).parts


def _run_rank(script: str, argv: list[str], env: dict[str, str], outputs: tuple[int | None, int | None],
              new_session: bool) -> None:
    """In the fork: `python -u script argv[1:]` under `env`, in a session of its own if asked; exits as Python does."""
    if new_session:
        os.setsid()
    for fd, output in zip((1, 2), outputs):
        if output is not None:
            os.dup2(output, fd)
    gc.collect()  # the launcher's garbage closes its descriptors now, not later when the numbers are the rank's
    gc.freeze()
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as Popen(close_fds=True): no store socket or pipe of the launcher
    _use_popen(_POPEN)  # the rank's own subprocesses (torch.compile's workers, say) are the real thing
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)  # the launcher's handlers, undone
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    for name, module in list(sys.modules.items()):  # the template's own code starts afresh (16 ms): its
        # module-level state, such as the launcher's pid that training/preemption.py records, is this rank's
        if _is_template_code(getattr(module, "__file__", None)):
            del sys.modules[name]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code: int | str | None = 0
    try:
        runpy.run_path(script, run_name="__main__")  # train.py leaves from inside, by os._exit
    except SystemExit as exited:
        code = exited.code
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # then as Python's own shutdown: see training/process_exit.py
    import atexit

    atexit._run_exitfuncs()
    sys.exit(code)  # multiprocessing's exit: a code, or a message and 1
