"""The part preemption: a stop signal saves and the next launch resumes exactly; ranks agree on the step."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from parts.preemption.signals import StopRequests
from tests.harness import (
    MAX_STEPS,
    REPO,
    SHOWN_FLAGS,
    SPLIT_OF,
    assert_continues_exactly,
    free_port,
    split_run_args,
    start,
    stop_after_step,
    train,
)
from training.parts import installed

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

STEPS_PER_EPOCH = 6  # of `uneven_data` at the global batch of 8


CASES = {
    # torchrun's agent forwards SIGTERM to every rank and waits for them
    "SIGTERM to the launcher of 2 DDP ranks": ("ddp", "launcher", signal.SIGTERM, "SIGTERM"),
    # what train.sbatch does at the time limit: the node script makes torchrun forward SIGUSR1 too
    "SIGUSR1 to the SLURM node script's launcher": ("deepspeed_zero2", "node script", signal.SIGUSR1, "SIGUSR1"),
    # one rank only: the other learns it from the ranks' agreement and stops at the same step
    "SIGUSR1 to FSDP2 rank 1 only": ("fsdp", "rank 1", signal.SIGUSR1, "SIGUSR1"),
    # the launcher dies of SIGUSR1 without forwarding it: the kernel sends its rank SIGTERM
    "SIGUSR1 to the launcher of one process": ("single", "launcher", signal.SIGUSR1, "SIGTERM"),
}


@pytest.mark.parametrize(("config", "target", "sig", "seen"), CASES.values(), ids=CASES.keys())
def test_a_stop_signal_saves_and_the_next_launch_continues_exactly(
    config, target, sig, seen, split_run, uneven_data, tmp_path
) -> None:
    args = split_run_args(uneven_data, SPLIT_OF[config])  # the config's run of test_accumulation, uninterrupted
    uninterrupted = split_run(SPLIT_OF[config])
    # The plain launch has torchrun's own grace, 30 s, as a user's `accelerate launch` does: the save fits in it
    launcher = start(config, tmp_path, *args, *SHOWN_FLAGS, via_node_script=target == "node script",
                     shutdown_timeout=None if (config, target) == ("ddp", "launcher") else "300")
    # Stop once the first epoch is logged (the ranks agreed on that step already), so the signal lands mid-way
    # through the second epoch, at step 7, 8 or 9 of 10, on any machine: the resume below is also test_resume.py's
    # resume of this config, from within an epoch that is not the first.
    stop_after_step(launcher, tmp_path, STEPS_PER_EPOCH, sig, processes=1 if config == "single" else 2,
                    to_rank_1=target == "rank 1")
    log = (tmp_path / "launch.log").read_text()
    stopped = [line for line in log.splitlines() if line.startswith("stopped: ")]
    assert len(stopped) == 1, log[-3000:]  # one report, not one per rank
    step = int(re.search(rf"{seen} received: stopped after step (\d+)", stopped[0]).group(1))
    assert STEPS_PER_EPOCH < step < MAX_STEPS and (tmp_path / "checkpoints" / f"step_{step}" / "trainer_state.json").is_file()
    assert (tmp_path / "report.png").is_file() == installed("report")  # a stopped run draws its picture too (the report part)
    if target == "rank 1":  # the launcher's failure report shows the ranks' exit code
        assert re.search(r"exitcode\s*:\s*75", log), log[-3000:]

    result = train(config, tmp_path, *args, "--resume_from_checkpoint", "latest")
    assert f"at step {step}" in result.stderr
    assert_continues_exactly(uninterrupted, tmp_path, step)


AGREEMENT = """
import json, signal, sys, torch.distributed as dist
from parts.preemption.signals import StopRequests
from training.process_exit import exit_process
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
requests = StopRequests()
seen = {}
for step in range(1, 13):
    if rank == 1 and step == 2:
        requests.handle(signal.SIGUSR1, None)  # rank 1 alone is signalled during step 2
    seen[step] = requests.agreed(step, now=step == 7, timeout_s=60)
print(json.dumps(seen))
dist.destroy_process_group()
exit_process(0)  # as train.py's ranks end: gloo's threads would otherwise race the interpreter's teardown
"""


@pytest.mark.quick
def test_ranks_agree_on_a_stop_every_few_steps_and_when_told_to() -> None:
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", AGREEMENT, str(rank), port], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    every = StopRequests.AGREE_EVERY
    for stdout, _ in outputs:  # both ranks learn it at the same step: the first agreement after the signal
        seen = {int(step): name for step, name in json.loads(stdout).items()}
        assert [step for step, name in seen.items() if name] == [s for s in range(every, 13) if s % every == 0 or s == 7]
        assert seen[every] == "SIGUSR1" and not any(seen[step] for step in range(1, every))
