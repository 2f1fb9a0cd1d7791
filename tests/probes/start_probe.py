"""Launched by tests/test_forked_launcher.py: what a rank finds as it starts, one JSON line per rank on stdout."""

import json
import os
import signal
import sys

libraries_imported = "transformers" in sys.modules  # before this script imports anything
template_imported = sorted(name for name in ("train", "training", "training.preemption", "models", "data") if name in sys.modules)
import torch  # noqa: E402
import train  # noqa: E402,F401  (what the forkserver imported: the environment it leaves, TorchInductor's cache dir)

descriptors = os.listdir("/proc/self/fd")  # the listing's own descriptor is the last one it opens
print(json.dumps({
    "libraries_imported": libraries_imported,
    "template_imported": template_imported,
    "threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
    "environment": dict(os.environ),
    "signal_handlers": {sig.name: str(signal.getsignal(sig)) for sig in (
        signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE,
        signal.SIGCHLD)},
    "descriptors": sorted(map(int, descriptors))[:-1],
    "argv": sys.argv,
    "path": sys.path[0],
    "cwd": os.getcwd(),
    "session_leader": os.getsid(0) == os.getpid(),
    "main": __name__,
    "stdout": [type(sys.stdout.buffer).__name__, sys.stdout.write_through],
}))
