"""Imported once per pytest worker, by the launchers' forkserver only (tests/forked_launcher.py): what
train.py imports (3 of a tiny rank's 4 CPU-s here), under the environment a suite launch gives its ranks,
so that the ranks those launchers start can be forks that run train.py without importing it all again.

Never imported by the tests themselves: it sets the suite's launch environment for the process.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys

from tests.forked_launcher import SUITE_LAUNCH_ENV

if "torch" in sys.modules:  # imported under another environment (OpenMP reads OMP_NUM_THREADS as torch loads)
    raise ImportError("tests.preloaded_train must be the forkserver's first import")  # no forked ranks then
os.environ.update(SUITE_LAUNCH_ENV)
IMPORTED_UNDER = dict(os.environ)  # a launch under any other environment gets ranks of its own
# A new interpreter's module path after the script's directory and PYTHONPATH's entries (this process has pytest's).
INTERPRETER_PATH = json.loads(subprocess.run(
    [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], capture_output=True, text=True,
    env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"}, check=True).stdout)

import train  # noqa: E402,F401  (imported, not run: its `__main__` part runs in each rank)

SET_BY_IMPORT = {key: value for key, value in os.environ.items() if IMPORTED_UNDER.get(key) != value}  # torch's
# inductor cache directory, say: what each rank's environment holds after the import it no longer runs
MAIN_PROCESS_TYPE = type(multiprocessing.current_process())  # multiprocessing's own, whose name it deletes
SIGNALS = {sig: signal.getsignal(sig) for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
           if signal.getsignal(sig) is not None}  # a new interpreter's, once the libraries are imported
gc.collect()
gc.freeze()  # shared by every fork, and never walked again by their collections
