"""A build's lock file left by a killed process, released (parts/fast_start)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
from torch.utils.cpp_extension import _get_build_directory


def release_abandoned_build_lock(extension: str) -> bool:
    """Remove a build's lock file that no process holds any more; whether there was one. torch waits on
    `<build dir>/lock` with no timeout, so one left by a killed process hangs every later load. Its holder keeps it
    open: a file no (own) process has open, still there a second later, is abandoned."""
    lock = Path(_get_build_directory(extension, verbose=False)) / "lock"

    def abandoned() -> bool:
        if not lock.exists():
            return False
        for process in psutil.process_iter():
            try:
                if any(Path(file.path) == lock for file in process.open_files()):
                    return False
            except psutil.Error:
                continue
        return True

    if not abandoned():
        return False
    time.sleep(1)
    if not abandoned():
        return False
    lock.unlink(missing_ok=True)
    print(f"warning: removed {lock}, left by a build of {extension} killed while it held it", file=sys.stderr, flush=True)
    return True
