"""`accelerate launch`, run by the suite in forks of processes that have imported what it runs.

Most of the suite's time is processes starting: about 130 launches, each a launcher that imports
torch and accelerate (2 CPU-s here) and ranks that import train.py's libraries (3 of the 4 CPU-s a
tiny run's rank takes). So:
- the launcher: a forkserver (Python's `multiprocessing`, one per pytest worker) imports accelerate's
  launch command and train.py's libraries once (tests/preloaded_train.py); each launch is a fork of
  it that runs that command's own `main` with the launch's arguments, environment and working
  directory, so the launcher's code is what `accelerate launch` runs, and a signal sent to it
  reaches that code as it would reach the command (tests/test_preemption.py);
- the ranks of a launch that `run` waits for: the launcher's `Popen` of `python [-u] train.py ...`
  (accelerate's for one process, torch's elastic agent's for several) becomes a fork of the launcher
  that runs the script as `__main__` with that command's arguments, environment, output and session,
  and what exec and a new interpreter's start would give it: the template's own modules imported
  afresh, signal handlers and mask, standard streams, module path, no descriptor of the launcher's,
  numpy's random seed (tests/test_forked_launcher.py compares them). Each rank is a process of its
  own, with its process group on gloo; what it skips is importing the libraries again. A fork cannot
  have its own string-hash seed (the ranks share one), its command line in /proc, or the native
  threads that libraries start as they load (pyarrow's allocator's, restarted on demand).

New interpreters remain where a fork could differ from one: ranks whose environment differs from
the one the libraries were imported under in a variable that a library reads as it is imported
(`HF_HOME`, `HF_HUB_OFFLINE`), commands other than a Python script, and the launches that `start`
makes for tests that signal, freeze or find the ranks (tests/test_preemption.py, tests/test_hangs.py),
where the stop handlers must be installed before any library loads; tests that signal ranks only
once they train ask `start` for forked ranks (tests/test_streaming.py), found by the records their
launcher keeps (`forked_rank`). Commands of their own run where the command is what is tested: the
SLURM node script (tests/test_preemption.py, tests/test_multinode.py), the machine flags of several
nodes (tests/test_multinode.py), the launch that limits one rank's address space
(tests/test_batch_size.py) and scripts/benchmark.py as a user runs it (tests/test_benchmarks.py's data
table; its other tables fork).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import multiprocessing
import os
import resource
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
# GNU readline (imported by pytest's debugger support) writes the terminal size into the C environment, which the
# forkserver would start with, though this process's os.environ lacks it: accelerate's menus read it at import.
for _name in {"COLUMNS", "LINES"} - os.environ.keys():
    os.unsetenv(_name)
# A rank reads the environment its launcher was started with (training/strategy/cpu.py: whether the user chose
# a thread count): a forked launcher's is the forkserver's, started with the suite's launch settings as a user's
# shell would export them.
for _name, _value in SUITE_LAUNCH_ENV.items():
    os.putenv(_name, _value)
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["tests.preloaded_train", "accelerate.commands.launch"])  # in this order
# Environment variables that no library reads as it is imported, only as a rank runs: what accelerate's launcher
# and torch's elastic agent set for each rank (prefixes end in "_"), torchrun's options (PET_: its launcher's parser
# reads them), PYTHONPATH (a rank's module path is rebuilt from it), DeepSpeed's CUDA check (set by importing it,
# in a test too), and the current test's name (pytest's).
# tests/test_forked_launcher.py imports what the forkserver imports and fails if any of these is read.
_READ_AT_RUN_TIME = ("ACCELERATE_DEEPSPEED_", "ACCELERATE_DYNAMO_", "FSDP_", "PARALLELISM_CONFIG_", "TORCHELASTIC_",
                     "KMP_", "PET_")
_READ_AT_RUN_TIME_NAMES = {
    "ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG",
    "ACCELERATE_MIXED_PRECISION", "ACCELERATE_CONFIG_DS_FIELDS", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "ACCELERATE_GRADIENT_CLIPPING", "ACCELERATE_DEBUG_MODE", "ACCELERATE_CPU_AFFINITY", "MASTER_ADDR", "MASTER_PORT",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
    "ROLE_WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHONPATH", "PYTORCH_NVML_BASED_CUDA_CHECK",
    "PYTEST_CURRENT_TEST"}


def read_at_run_time_only(name: str) -> bool:
    """Whether `name` is on the list above: a launch whose environment differs only in these may fork its ranks."""
    return name in _READ_AT_RUN_TIME_NAMES or name.startswith(_READ_AT_RUN_TIME)


_POPEN = subprocess.Popen
_PR_SET_NAME = 15  # from <linux/prctl.h>


# A forked rank's command line and /proc environment are the forkserver's: its launcher records its global rank
# here, by process id, for the tests that find a launch's ranks (tests/conftest.py `rank_processes`).
@functools.cache
def rank_records() -> Path:
    """The directory of those records, made by the first launch of this process (tests/conftest.py removes it as
    pytest ends: an atexit hook would be one more in every forked rank)."""
    return Path(tempfile.mkdtemp(prefix="forked-ranks-"))


def forked_rank(pid: int) -> int | None:
    """The global rank of the running forked rank `pid`; None for any other process."""
    try:
        return int((rank_records() / str(pid)).read_text())
    except (FileNotFoundError, ValueError):  # not a forked rank, or one whose record is being written
        return None


def run_launch_command(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str,
                       new_session: bool = False, fork_ranks: bool = False, address_space: int | None = None,
                       ranks_dir: Path | None = None) -> None:
    """In the fork: accelerate's `launch` command with `argv`, output to the files `stdout` and `stderr` (one
    file for both if they are the same path); `new_session`: as the leader of a session of its own;
    `fork_ranks`: its ranks forked from this process where they can be (the module's docstring);
    `address_space`: the bytes this launcher and every rank may map (`prlimit --as` around a command);
    `ranks_dir`: where the forked ranks are recorded (`rank_records` of the process that started this one)."""
    if new_session:
        os.setsid()
    if address_space is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    if fork_ranks:
        _fork_ranks(ranks_dir)
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
    except SystemExit as exited:  # as Python exits: a code, or a message and 1
        code = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
        if exited.code is not None and not isinstance(exited.code, int):
            print(exited.code, file=sys.stderr)
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

    def kill(self) -> None:
        kill_tree(self.pid)


def start(argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path | None = None,
          new_session: bool = True, fork_ranks: bool = False, address_space: int | None = None) -> Launcher:
    """`accelerate launch <argv>` started, not waited for: by default in a session of its own (as
    `Popen(start_new_session=True)`) with both output streams to `stdout`, and ranks that are new interpreters;
    `address_space`: the bytes the launcher and its ranks may each map (as `prlimit --as` around the command)."""
    process = _FORKSERVER.Process(target=run_launch_command, args=(
        argv, env, str(cwd), str(stdout), str(stderr or stdout), new_session, fork_ranks, address_space, rank_records()))
    process.start()
    return Launcher(process, ["accelerate", "launch", *argv])


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float,
        address_space: int | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch <argv>` under `env` in `cwd`, waited for, as `subprocess.run(capture_output=True, text=True)`
    gives it (`address_space`: as `start`'s). On a timeout the launcher and everything it started are killed, and
    `subprocess.TimeoutExpired` raised."""
    with tempfile.TemporaryDirectory(prefix="launch-") as scratch:
        stdout, stderr = Path(scratch, "stdout"), Path(scratch, "stderr")
        launcher = start(argv, env, cwd, stdout, stderr, new_session=False, fork_ranks=True, address_space=address_space)
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


def _fork_ranks(ranks_dir: Path) -> None:
    """Have this launcher fork the ranks it would start as `python [-u] <script>.py ...`, where their environment
    differs from the one the libraries were imported under in variables read at run time alone; `Popen` as
    before for anything else."""
    preloaded = sys.modules.get("tests.preloaded_train")  # absent where its import failed: no forks then
    if preloaded is None:
        return

    def rank_process(args, env=None, stdout=None, stderr=None, start_new_session=False, **others):
        command, rank_env = _python_command(args), dict(os.environ if env is None else env)
        differing = {key for key in rank_env.keys() | preloaded.IMPORTED_UNDER.keys()
                     if rank_env.get(key) != preloaded.IMPORTED_UNDER.get(key)}
        if command is None or others or isinstance(stdout, int) or isinstance(stderr, int) or not all(
                map(read_at_run_time_only, differing)):
            return _POPEN(args, env=env, stdout=stdout, stderr=stderr, start_new_session=start_new_session, **others)
        return ForkedRank(args, *command, preloaded.SET_BY_IMPORT | rank_env, stdout, stderr, start_new_session, ranks_dir)

    _use_popen(rank_process)  # in this launcher alone: it is a fork


def _use_popen(popen) -> None:
    """`popen` as what accelerate's launcher and torch's elastic agent call to start a rank."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    subprocess.Popen = subprocess_handler.Popen = popen


def _python_command(args) -> tuple[list[str], bool] | None:
    """`[script, *its arguments]` and whether `-u` was given, for `[this python, (-u), script.py, ...]`; else None."""
    args = [str(arg) for arg in args]
    unbuffered = len(args) > 2 and args[1] == "-u"
    argv = args[2 if unbuffered else 1:]
    if len(args) < 2 or args[0] != sys.executable or not argv[0].endswith(".py") or not os.path.isfile(argv[0]):
        return None
    return argv, unbuffered


class ForkedRank:
    """What accelerate's launcher and torch's elastic agent use of `subprocess.Popen`, for a rank that is a fork
    of the launcher running a Python script as a new interpreter would."""

    def __init__(self, args, argv: list[str], unbuffered: bool, env: dict[str, str], stdout, stderr,
                 new_session: bool, ranks_dir: Path) -> None:
        self.args, self.returncode = args, None
        outputs = tuple(None if stream is None else stream.fileno() for stream in (stdout, stderr))
        started_r, started_w = os.pipe()
        # Signals wait until the rank has a new interpreter's handlers, as they would for a process not yet exec'd.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            self._process = multiprocessing.get_context("fork").Process(
                target=_run_rank, args=(argv, unbuffered, env, outputs, new_session, mask, started_w))
            self._process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(started_w)
        self.pid = self._process.pid
        self._record = ranks_dir / str(self.pid)
        self._record.with_suffix(".new").write_text(env.get("RANK", "0"))
        self._record.with_suffix(".new").rename(self._record)
        os.read(started_r, 1)  # as Popen returns: once the rank is in its session, so that killpg finds it
        os.close(started_r)

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():  # is_alive reaps it
            self.returncode = self._process.exitcode
            self._record.unlink(missing_ok=True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:  # not join(timeout): once the pipe it watches closes, it waits without a limit
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


def _run_rank(argv: list[str], unbuffered: bool, env: dict[str, str], outputs: tuple[int | None, int | None],
              new_session: bool, mask: set[signal.Signals], started: int) -> None:
    """In the fork, what `exec` and a new interpreter's start would give the rank, then its script as `__main__`."""
    preloaded = sys.modules["tests.preloaded_train"]
    if new_session:
        os.setsid()
    ctypes.CDLL(None).prctl(_PR_SET_NAME, os.path.basename(sys.executable).encode()[:15])  # its name, not the agent's
    for sig, handler in preloaded.SIGNALS.items():  # the launcher's handlers undone
        signal.signal(sig, handler)
    _use_popen(_POPEN)  # the rank's own subprocesses (torch.compile's workers, say) are the real thing
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.write(started, b"1")
    for fd, output in zip((1, 2), outputs):
        if output is not None:
            os.dup2(output, fd)
    gc.freeze()  # the launcher's objects: never collected here, so no finalizer of the launcher's runs in the rank
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as Popen(close_fds=True): no store socket or pipe of the launcher
    _new_standard_streams(unbuffered or bool(env.get("PYTHONUNBUFFERED")))
    os.environ.clear()
    os.environ.update(env)
    for name, module in list(sys.modules.items()):  # the template's own code starts afresh (16 ms): its
        # module-level state, such as the launcher's pid that parts/preemption/signals.py records, is this rank's
        if _is_template_code(getattr(module, "__file__", None)):
            del sys.modules[name]
    script = os.path.abspath(argv[0])
    sys.argv = argv
    sys.path[:] = [os.path.dirname(os.path.realpath(script))]  # then PYTHONPATH's and the interpreter's, as site lists them
    for entry in [*filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), *preloaded.INTERPRETER_PATH]:
        if os.path.abspath(entry) not in sys.path[1:]:
            sys.path.append(os.path.abspath(entry))
    multiprocessing.process._current_process = preloaded.MAIN_PROCESS_TYPE()  # a main process, not the launcher's child
    multiprocessing.process._parent_process = None
    import numpy

    numpy.random.seed()  # a new interpreter's draw (Python's `random` draws again at every fork by itself)
    code: int | str | None = 0
    try:
        _run_as_main(script)  # train.py leaves from inside, by os._exit
    except SystemExit as exited:
        code = exited.code
    except KeyboardInterrupt:  # as Python: the traceback, then death by SIGINT
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # then as Python's own shutdown: see training/process_exit.py
    import atexit

    atexit._run_exitfuncs()
    sys.exit(code)  # multiprocessing's exit: a code, or a message and 1


def _run_as_main(script: str) -> None:
    """The script as `python script.py` runs it: the module `__main__`, with its absolute path as `__file__`."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", script))
    sys.modules["__main__"] = main
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec")
    exec(code, main.__dict__)


def _new_standard_streams(unbuffered: bool) -> None:
    """stdin, stdout and stderr as a new interpreter makes them on descriptors 0, 1 and 2 (`-u`: unbuffered)."""
    import io

    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        encoding, errors = (getattr(getattr(sys, f"__{name}__"), key, default) for key, default in (
            ("encoding", "utf-8"), ("errors", "backslashreplace" if fd == 2 else "strict")))
        try:
            raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        except OSError:  # a closed descriptor: Python's stream is None
            stream = None
        else:
            writer = raw if unbuffered and fd else (io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw))
            stream = io.TextIOWrapper(writer, encoding=encoding, errors=errors, write_through=unbuffered,
                                      line_buffering=fd == 2 and not unbuffered or fd > 0 and raw.isatty())
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
