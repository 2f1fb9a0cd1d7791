"""Launched by tests/test_forked_launcher.py: what a rank finds as it starts, one JSON line per rank on stdout;
with `--exit_code N`, the last rank then exits with N."""

import atexit
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

libraries_imported = "transformers" in sys.modules  # before this script imports anything
template_imported = sorted(name for name in ("train", "training", "parts.preemption", "models", "data") if name in sys.modules)
import numpy  # noqa: E402
import torch  # noqa: E402

import train  # noqa: E402,F401  (what the forkserver imported: the environment it leaves, TorchInductor's cache dir)

descriptors = os.listdir("/proc/self/fd")  # the listing's own descriptor is the last one it opens
streams = {name: None if stream is None else [stream.fileno(), type(stream.buffer).__name__, stream.encoding, stream.errors,
                                              stream.line_buffering, stream.write_through]
           for name, stream in (("stdin", sys.stdin), ("stdout", sys.stdout), ("stderr", sys.stderr))}
os.write(1, json.dumps({
    "libraries_imported": libraries_imported,
    "template_imported": template_imported,
    "threads": [torch.get_num_threads(), torch.get_num_interop_threads(),
                sorted(thread.name for thread in threading.enumerate())],
    "native_threads": sorted(Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")),
    "environment": dict(os.environ),
    "signal_handlers": {int(sig): str(signal.getsignal(sig)) for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}},
    "signal_mask": sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, []))),
    "descriptors": sorted(map(int, descriptors))[:-1],
    "streams": streams,
    "argv": sys.argv,
    "file": __file__,
    "path": sys.path,
    "cwd": os.getcwd(),
    "session_leader": os.getsid(0) == os.getpid(),
    "main": __name__,
    "process": [multiprocessing.current_process().name, multiprocessing.parent_process() is None],
    "atexit_callbacks": atexit._ncallbacks(),
    "numpy_draw": numpy.random.randint(2**31),  # differs between the ranks, as each new interpreter draws its own seed
}).encode() + b"\n")  # one write: the ranks share the file
if "--exit_code" in sys.argv:
    # The last rank leaves once every rank has written its line: its exit ends the launch, and a rank still
    # importing (new interpreters on a loaded machine) would be ended before it wrote.
    written = Path(tempfile.gettempdir(), f"start-probe-{os.environ.get('MASTER_PORT', 'single')}")
    written.mkdir(exist_ok=True)
    (written / os.environ.get("RANK", "0")).touch()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == world_size - 1:
        deadline = time.monotonic() + 120
        while len(list(written.iterdir())) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(written, ignore_errors=True)
        sys.exit(int(sys.argv[sys.argv.index("--exit_code") + 1]))
