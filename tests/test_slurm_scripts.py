"""scripts/slurm/train.sbatch as SLURM runs it on node 1 of 2, with stand-in `srun`, `scontrol` and
`accelerate` on PATH: the launch line each node gets (tests/test_multinode.py trains through
launch_node.sh for real)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.quick  # every test here: the quick tier (pytest -m quick)

JOB_ID = 123456
SLURM_NODE_1_OF_2 = {"SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2",
                     "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "32"}
STAND_INS = {
    # srun: record the options, then run the command on "this node"
    "srun": """
        import itertools, json, os, subprocess, sys
        options = list(itertools.takewhile(lambda arg: arg.startswith("--"), sys.argv[1:]))
        open(os.environ["RECORD"] + "/srun.json", "w").write(json.dumps(options))
        sys.exit(subprocess.call(sys.argv[1 + len(options):]))
    """,
    "scontrol": """
        import sys
        print("node-a\\nnode-b" if sys.argv[1:3] == ["show", "hostnames"] else "", end="")
    """,
    # accelerate: record the launch line and the environment it would start the ranks with
    "accelerate": """
        import json, os, sys
        keep = ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "PET_SIGNALS_TO_HANDLE", "PET_SHUTDOWN_TIMEOUT")
        record = {"argv": sys.argv[1:], "env": {key: os.environ.get(key) for key in keep}}
        open(os.environ["RECORD"] + "/accelerate.json", "w").write(json.dumps(record))
    """,
}


@pytest.fixture
def stand_ins(tmp_path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(
    ("extra_env", "precision", "gloo_interface"),
    [
        ({"MIXED_PRECISION": "bf16", "NCCL_SOCKET_IFNAME": "lo"}, ["--mixed_precision", "bf16"], "lo"),
        ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, [], None),  # NCCL's exclusion syntax means nothing to gloo
    ],
    ids=["bf16 and an interface", "defaults"],
)
def test_sbatch_gives_each_node_its_launch_line(stand_ins, tmp_path, extra_env, precision, gloo_interface) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "MASTER_", "GLOO_", "NCCL_"))}
    env |= SLURM_NODE_1_OF_2 | extra_env | {"PATH": f"{stand_ins}{os.pathsep}{env['PATH']}", "RECORD": str(tmp_path)}
    done = subprocess.run(["bash", "scripts/slurm/train.sbatch", "--output_dir", "/shared/runs/exp1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "srun.json").read_text()) == ["--kill-on-bad-exit=1", "--cpus-per-task=32"]
    launched = json.loads((tmp_path / "accelerate.json").read_text())
    port = str(15000 + JOB_ID % 15000)  # one per job: two jobs on one head node do not collide
    assert launched["argv"] == [
        "launch", "--config_file", "accelerate_configs/fsdp.yaml", *precision,
        "--num_machines", "2", "--num_processes", "16", "--machine_rank", "1",
        "--rdzv_backend", "c10d", "--main_process_ip", "node-a", "--main_process_port", port, "--max_restarts", "0",
        "train.py", "--resume_from_checkpoint", "latest", "--output_dir", "/shared/runs/exp1",
    ]
    assert launched["env"] == {"GLOO_SOCKET_IFNAME": gloo_interface, "OMP_NUM_THREADS": "1",
                               "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                               "PET_SHUTDOWN_TIMEOUT": "300"}
