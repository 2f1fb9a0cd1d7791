"""Imported once per pytest worker, by the launchers' forkserver only (tests/forked_launcher.py): what
train.py imports (3 of a tiny rank's 4 CPU-s here), under the environment a suite launch gives its ranks,
so that the ranks those launchers start can be forks that run train.py without importing it all again.

Never imported by the tests themselves: it sets the suite's launch environment for the process.
"""

from __future__ import annotations

import gc
import io
import os
import sys

from tests.forked_launcher import SUITE_LAUNCH_ENV

if "torch" in sys.modules:  # imported under another environment (OpenMP reads OMP_NUM_THREADS as torch loads)
    raise ImportError("tests.preloaded_train must be the forkserver's first import")  # no forked ranks then
os.environ.update(SUITE_LAUNCH_ENV)
IMPORTED_UNDER = dict(os.environ)  # a launch under any other environment gets ranks of its own
for name in ("stdout", "stderr"):  # as `python -u`, which the launchers give their ranks
    stream = getattr(sys, name)
    setattr(sys, name, io.TextIOWrapper(io.FileIO(stream.fileno(), "w", closefd=False), encoding=stream.encoding,
                                        errors=stream.errors, write_through=True))

import train  # noqa: E402,F401  (imported, not run: its `__main__` part runs in each rank)

SET_BY_IMPORT = {key: value for key, value in os.environ.items() if IMPORTED_UNDER.get(key) != value}  # torch's
# inductor cache directory, say: what each rank's environment holds after the import it no longer runs
gc.collect()
gc.freeze()  # shared by every fork, and never walked again by their collections
