"""Launched by tests/test_clean_exit.py: train.py as `accelerate launch` runs it, recording how each rank ends.

Just before the rank leaves through `exit_process`, it writes OUT_DIR/rank_<rank>.json:
the exit code, the Python threads that Python's shutdown would wait for, whether a process
group is still initialized, and which gloo worker threads are still alive (the ones that can
abort an interpreter teardown). Usage: exit_probe.py OUT_DIR <train.py flags>; with EXIT_PROBE_FAILING_STEP=1
in the environment, the training step raises an AssertionError.
"""

import json
import os
import sys
import threading
from pathlib import Path

import torch.distributed as dist

out_dir = Path(sys.argv.pop(1))
import train  # noqa: E402  (after the argv edit: train.py parses the remaining flags)


def os_thread_names() -> list[str]:
    return sorted(Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task"))


def recording_exit(code: int) -> None:
    record = {
        "code": code,
        "non_daemon_threads": [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()],
        "process_group_initialized": dist.is_initialized(),
        "gloo_threads_alive": [name for name in os_thread_names() if name.startswith(("pt_gloo", "gloo"))],
    }
    (out_dir / f"rank_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
    exit_process(code)


def failing_step(run, window, nonfinite):
    raise AssertionError("an error train.py does not document")  # as torch's checkpoint reader raised one


if os.environ.get("EXIT_PROBE_FAILING_STEP"):  # every training step raises an exception no handler names
    train.optimizer_step = failing_step
exit_process = train.exit_process
recording_exit(train.run())
