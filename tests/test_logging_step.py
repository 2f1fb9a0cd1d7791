"""A logging step reduces everything it reports, and the non-finite check, in one collective
(training/collectives.py `gather_scalars`): 2 real processes over gloo, collectives counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import REPO, free_port
from training.parts import installed

pytestmark = pytest.mark.quick  # every test here: the quick tier (pytest -m quick)

LOGGING_STEP = """
import json, math, torch, torch.distributed as dist
from accelerate import Accelerator
from training.collectives import gather_scalars
from training.step import NonFiniteGuard
from training.parts import installed
from training.performance import SpeedMeter
from training.process_exit import exit_process

accelerator = Accelerator(cpu=True)  # DDP on CPU: gloo over the 2 processes
rank = accelerator.process_index
guard = NonFiniteGuard(accelerator.device, loss_scaling=True)
guard.update(1, torch.tensor(2.0), torch.tensor(math.inf if rank == 1 else 1.0))  # rank 1's step overflowed
figures = []  # MFU's peak travels in the same collective (parts/mfu, where installed)
if installed("mfu"):
    from parts.mfu.peaks import Mfu

    figures = [Mfu(accelerator.device, flops_per_unit=10.0, peak=1e15)]  # per rank
speed = SpeedMeter(accelerator.device, figures=figures)
speed.resume()
speed.end_step(units=100 * (rank + 1))
calls = []
for name in ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce", "gather"):
    original = getattr(dist, name)
    setattr(dist, name, lambda *a, _original=original, _name=name, **k: calls.append(_name) or _original(*a, **k))

interval_loss = torch.tensor(0.25 * (rank + 1))  # each rank's share of the global mean
grad_norm = torch.tensor(3.0)
ranks = gather_scalars(accelerator, guard.local() | {"loss": interval_loss, "grad_norm": grad_norm} | speed.interval())
guard.check(ranks)
report = speed.report(ranks)
print(json.dumps({"collectives": calls, "loss": float(ranks["loss"].sum()), "grad_norm": float(ranks["grad_norm"].max()),
                  "skipped": guard.logged(ranks), "tokens_per_sec": report["tokens_per_sec"], "mfu": report.get("mfu"),
                  "unit_rates": ranks["units_per_sec"].tolist()}))
dist.destroy_process_group()
exit_process(0)
"""


def test_a_logging_step_is_one_collective_for_every_figure() -> None:
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
                        "PYTHONPATH": str(REPO)}
    ranks = [subprocess.Popen([sys.executable, "-c", LOGGING_STEP], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    for stdout, _ in outputs:  # every rank holds the same figures
        seen = json.loads(stdout.strip().splitlines()[-1])
        assert seen["collectives"] == ["all_gather"]  # gloo has no all_gather_into_tensor
        assert seen["loss"] == 0.75 and seen["grad_norm"] == 3.0
        assert seen["skipped"] == {"skipped_steps": 1}  # one rank's overflow counts for the step
        rate_0, rate_1 = seen["unit_rates"]
        assert rate_0 > 0 and rate_1 > 0 and seen["tokens_per_sec"] == rate_0 + rate_1  # the ranks add up
        if installed("mfu"):
            assert seen["mfu"] == pytest.approx((rate_0 + rate_1) * 10.0 / 2e15)
