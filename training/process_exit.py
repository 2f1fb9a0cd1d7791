"""How a rank ends: Python's shutdown minus the interpreter teardown, where gloo can abort a finished run.

The abort (issue 22; about 1 in 135 short 2-process launches, seen on ZeRO-3 and FSDP): a
rank prints `terminate called without an active exception` and dies with SIGABRT after it
trained, saved and exported, so `accelerate launch` exits 1. A core dump shows why:
- gloo runs every collective on its own worker threads (`pt_gloo_runloop`), and the worker
  destroys the finished work object, dropping the Python tensors it held, which takes the GIL;
- those threads live as long as anything refers to their process group, and
  `destroy_process_group` does not stop them. On every strategy here they are still alive
  when `main()` returns: DeepSpeed, for one, keeps the group in module globals
  (`deepspeed.utils.groups._WORLD_GROUP`) and on every ZeRO-3 parameter (`ds_process_group`);
- if the interpreter is already finalizing when a worker asks for the GIL, CPython (3.11)
  ends that thread with `pthread_exit`, whose forced unwind meets a `noexcept` C++ frame:
  `std::terminate`. The last collective before exit makes this a race.
Upstream: pytorch/pytorch#179291 (an atexit hook destroying process groups; abandoned,
since a group still referenced elsewhere keeps its threads anyway). `tests/test_clean_exit.py`
reproduces the abort with a held group, and `scripts/stress_launch.py` counts it per config.

So a rank ends the way Python would (threading shut down, atexit handlers run,
streams flushed) and then leaves with `os._exit`, never entering the teardown. The exit
code is the one given: a failed rank still exits non-zero.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """End this process with `code` after everything Python's own shutdown would run before teardown."""
    # Py_FinalizeEx's own first step: run threading's atexit hooks (concurrent.futures stops
    # its idle pool workers there; torch.compile's pools would otherwise never return), then
    # wait for the non-daemon threads. Joining them by hand skips those hooks and deadlocks.
    threading._shutdown()
    atexit._run_exitfuncs()  # logging.shutdown, trackers, temporary files, dataloader workers
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
