"""How a rank ends: Python's shutdown minus the interpreter teardown, where gloo can abort a finished run.

Issue 22 (about 1 in 135 short 2-process launches): a rank that trained and exported died of SIGABRT (`terminate
called without an active exception`). gloo's worker threads outlive `destroy_process_group` (DeepSpeed keeps the group
in globals and on ZeRO-3 parameters); one that asks for the GIL while CPython 3.11 finalizes is ended by
`pthread_exit`, whose unwind meets a `noexcept` C++ frame. Upstream: pytorch/pytorch#179291 (abandoned);
tests/test_clean_exit.py reproduces it, scripts/stress_launch.py counts it per config.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """End this process with `code` after everything Python's own shutdown would run before teardown."""
    # Py_FinalizeEx's first step: threading's atexit hooks (concurrent.futures stops idle pool workers there, else
    # torch.compile's pools never return), then the non-daemon threads; joining them by hand skips the hooks: deadlock.
    threading._shutdown()
    atexit._run_exitfuncs()  # logging.shutdown, trackers, temporary files, dataloader workers
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
