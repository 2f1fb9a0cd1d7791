"""The suite's launches and shared helpers, as plain functions: real `accelerate launch` runs of train.py on CPU, and
small local datasets. A launch is a plain subprocess, as a user's shell runs it, unless the test opts into forked
launches (`@pytest.mark.forked`, or `pytestmark` for a module): then accelerate's launch command runs in a fork of
a process that imported it once (tests/forked_launcher.py), the same launch, seconds faster. The fixtures that
train a run once per test run are in tests/conftest.py; a part's own, in tests/fixtures/<part>.py.
"""

from __future__ import annotations

import ast
import os

# The suite tests CPU semantics (gloo, the CPU accommodation, the fp16 and SyncBatchNorm
# refusals): GPUs are hidden from it and from every launch, before torch can see them.
# Tests marked `gpu` get them back (`launch(..., gpu=True)`) and are skipped without one.
# (Hence the imports below this line; tests/conftest.py imports this module first.) A second import (a probe's)
# must still see the machine's setting.
os.environ.setdefault("SUITE_CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
VISIBLE_GPUS = None if os.environ["SUITE_CUDA_VISIBLE_DEVICES"] == "<unset>" else os.environ["SUITE_CUDA_VISIBLE_DEVICES"]
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import signal

# A suite started in the background of a non-interactive shell (`cmd &`, nohup) inherits SIGINT and SIGQUIT
# ignored, and every launch would inherit that from it: the suite and its launches start from a terminal's
# dispositions instead, so that no test depends on how its caller's shell started it.
for _signal in (signal.SIGINT, signal.SIGQUIT):
    if signal.getsignal(_signal) == signal.SIG_IGN:
        signal.signal(_signal, signal.default_int_handler if _signal == signal.SIGINT else signal.SIG_DFL)

import json
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from filelock import FileLock
from safetensors.torch import load_file

from data.default_corpus import generate_documents
from tests import forked_launcher
from training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
# Small and fast: the tiny model trains a few steps in seconds per process. Each evaluation reads the
# first 60 validation blocks: on 2 processes x 4 the last batch is uneven (7.5 batches). TINY_RUN ends with the
# installed parts' SUITE_FLAGS (tests/fixtures/<part>.py: a part's switch for what only its tests look at), added
# by tests/conftest.py as pytest starts.
EVAL_SAMPLES = 60
SUITE_FLAGS: list[str] = []
SHOWN_FLAGS: list[str] = []  # the parts' flags for a run whose outputs a test looks at (report.png drawn)
PARITY_FLAGS: list[str] = []  # the parts' flags for the parity runs (`parity_args`): a part compared across configs
TINY_RUN = ["--model_config", "llama-tiny", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
            "--learning_rate", "3e-3", "--warmup_steps", "2", "--max_eval_samples", str(EVAL_SAMPLES)]
FORKED = False  # whether the running test opted into forked launches (`@pytest.mark.forked`): tests/conftest.py sets it


# Splits of one global batch of 8: name -> (config, per-device batch, accumulation steps).
SPLITS = {
    "1x8x1": ("single", 8, 1),
    "2x4x1": ("ddp", 4, 1),
    "2x2x2": ("ddp", 2, 2),
    "1x2x4": ("single", 2, 4),
    "zero2-2x2x2": ("deepspeed_zero2", 2, 2),
    "fsdp-2x2x2": ("fsdp", 2, 2),
    "zero3-2x4x1": ("deepspeed_zero3", 4, 1),
    "zero1-2x4x1": ("deepspeed_zero1", 4, 1),
}
SPLIT_OF = {"single": "1x8x1", "ddp": "2x4x1", "fsdp": "fsdp-2x2x2", "deepspeed_zero1": "zero1-2x4x1",
            "deepspeed_zero2": "zero2-2x2x2", "deepspeed_zero3": "zero3-2x4x1"}  # each config's split run
MAX_STEPS = 10  # with 6 steps per epoch on `uneven_data`: crosses into the second epoch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config_path(config: str | Path) -> Path:
    """A config name from accelerate_configs/, or a path to any accelerate yaml."""
    return config if isinstance(config, Path) else CONFIGS / f"{config}.yaml"


def with_processes(config: str, num_processes: int, directory: Path) -> Path:
    """The config with another `num_processes` (what `--num_processes` on the command line does)."""
    launcher = yaml.safe_load(config_path(config).read_text()) | {"num_processes": num_processes}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{config}-{num_processes}.yaml"
    path.write_text(yaml.safe_dump(launcher))
    return path


def gpu_count() -> int:
    """GPUs the tests may use, counted with nvidia-smi (this process never initialises CUDA)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    gpus = sum(line.startswith("GPU ") for line in listed.splitlines())
    return gpus if VISIBLE_GPUS is None else min(gpus, len([g for g in VISIBLE_GPUS.split(",") if g.strip()]))


LAUNCHER = [sys.executable, "-m", "accelerate.commands.launch"]  # `accelerate launch`, from this environment


def launch_command(
    config: str | Path, script: str | Path, *args: str, launcher_args: tuple[str, ...] = (), gpu: bool = False,
    env: dict[str, str] | None = None, fresh: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of `accelerate launch --config_file <config> <launcher_args> <script> <args>`;
    `gpu`: with the machine's GPUs visible; `env`: variables added; `fresh`: the user's environment (none of the
    suite's launch settings: the threads, the module path), for `python -m accelerate... train.py` from the repo."""
    command = [*LAUNCHER, "--config_file", str(config_path(config)),
               "--main_process_port", str(free_port()), *launcher_args, str(script), *args]
    # fresh: a user who chose no thread count (the caller's shell may have: the runs must not depend on it)
    suite = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"} if fresh else \
        os.environ | forked_launcher.SUITE_LAUNCH_ENV
    env = suite | (env or {})
    if gpu:
        env.pop("CUDA_VISIBLE_DEVICES")
        env |= {"CUDA_VISIBLE_DEVICES": VISIBLE_GPUS} if VISIBLE_GPUS is not None else {}
    return command, env


def launch(
    config: str | Path, script: str | Path, *args: str, launcher_args: tuple[str, ...] = (), timeout: int = 300,
    gpu: bool = False, env: dict[str, str] | None = None, fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run `accelerate launch` for real and wait for it, as a user's shell runs it: new interpreters for the launcher
    and every rank. A test marked `forked` runs its `main` in a fork of a process that imported it instead
    (tests/forked_launcher.py), so that the launcher does not import torch again for each of the suite's launches;
    `fresh` (the user's environment) and `gpu` launches are never forked."""
    command, env = launch_command(config, script, *args, launcher_args=launcher_args, gpu=gpu, env=env, fresh=fresh)
    if gpu or fresh or not FORKED:  # a launcher that imports torch itself (with the GPUs visible: `gpu`)
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return forked_launcher.run(command[len(LAUNCHER):], env, REPO, timeout)


# torchrun's report that a rank failed: the launcher's own traceback, ending in ChildFailedError
LAUNCHER_REPORT = re.compile(r"Traceback \(most recent call last\):\n(?: .*\n)*torch\.distributed\.elastic\.multiprocessing"
                             r"\.errors\.ChildFailedError:.*\n")


def bad_input_errors(result: subprocess.CompletedProcess) -> list[str]:
    """The `error:` lines of a launch that refused bad input: exit code 2 in torchrun's report of the ranks
    (the launcher itself exits 1), and no traceback but that report's."""
    assert result.returncode != 0 and re.search(r"exitcode\s*:\s*2\b", result.stderr), result.stderr[-4000:]
    assert "Traceback" not in LAUNCHER_REPORT.sub("", result.stderr, count=1), result.stderr[-4000:]
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


def train(
    config: str | Path, output_dir: Path, *args: str, launcher_args: tuple[str, ...] = (), fresh: bool = False
) -> subprocess.CompletedProcess:
    """Run train.py with the tiny model (`fresh`: new interpreters); fail the test with the run's output if it fails."""
    result = launch(config, "train.py", *TINY_RUN, "--output_dir", str(output_dir), *args, launcher_args=launcher_args,
                    fresh=fresh)
    assert result.returncode == 0, f"train.py failed under {config}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def logged_after(output_dir: Path, first_step: int) -> dict[tuple[int, str], float]:
    """Every logged loss, lr and eval_loss after `first_step`."""
    return {(m["step"], key): m[key] for m in read_metrics(output_dir) if m["step"] > first_step
            for key in ("loss", "lr", "eval_loss") if key in m}


def assert_continues_exactly(uninterrupted: Path, resumed: Path, from_step: int, last_step: int = MAX_STEPS,
                             weights: str = "model.safetensors", bit_exact: bool = False) -> None:
    """The resumed run logged the same losses, lr and eval as the uninterrupted one, and ends with its weights
    (final/`weights`: the model, or a LoRA adapter); to the last bit with `bit_exact`."""
    expected, actual = logged_after(uninterrupted, from_step), logged_after(resumed, from_step)
    assert sorted(step for step, key in actual if key == "loss") == list(range(from_step + 1, last_step + 1))
    assert actual.keys() == expected.keys()
    for entry in expected:
        assert actual[entry] == (expected[entry] if bit_exact else pytest.approx(expected[entry], rel=1e-6, abs=1e-7)), entry
    assert_same_final_weights(uninterrupted, resumed, atol=0 if bit_exact else 1e-6, weights=weights)



def tiny_resnet() -> torch.nn.Module:
    """A small transformers ResNet (convolutions, BatchNorm, no tensor-parallel plan), built without the images part."""
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                                     layer_type="basic", num_labels=2))


def nudged_copy(model_dir: Path, directory: Path) -> Path:
    """`model_dir` copied to `directory` with one weight moved: the same configuration and tokenizer, other weights
    (a frozen model a resume must not take for the one its checkpoint was trained against)."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, directory)
    weights = load_file(directory / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = weights[first] + 0.01
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def assert_same_final_weights(expected: Path, actual: Path, atol: float, weights: str = "model.safetensors") -> None:
    """Both runs exported the same tensors to final/`weights`, to within `atol`."""
    want, got = (load_file(run / "final" / weights) for run in (expected, actual))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)


NODE_SCRIPT = REPO / "scripts" / "slurm" / "launch_node.sh"


def node_script_command(
    config: str, *args: str, nnodes: int = 1, node_rank: int = 0, procs_per_node: int = 2, port: int | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of `scripts/slurm/launch_node.sh <args>`: what train.sbatch runs on each node."""
    _, env = launch_command(config, "train.py")
    env |= {"CONFIG": str(config_path(config)), "NNODES": str(nnodes), "NODE_RANK": str(node_rank),
            "PROCS_PER_NODE": str(procs_per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or free_port()),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # this venv's `accelerate`
    return [str(NODE_SCRIPT), *args], env


def start(config: str | Path, output_dir: Path, *args: str, via_node_script: bool = False,
          shutdown_timeout: str | None = "300", fork_ranks: bool = False,
          restarts: int = 0) -> subprocess.Popen | forked_launcher.Launcher:
    """Start train.py with the tiny model in the background, in its own session; output to output_dir/launch.log.
    The launcher: accelerate's launch command (in a fork under `@pytest.mark.forked`: tests/forked_launcher.py),
    or the SLURM node script.
    `shutdown_timeout`: torchrun's grace after a signal (PET_SHUTDOWN_TIMEOUT); None: its default, 30 s.
    `fork_ranks`: ranks forked too, for a test that signals them only once they train (their stop handlers are
    installed as train.py starts, after the libraries loaded); else new interpreters. `restarts`: torchrun's
    `--max_restarts` (the node script's MAX_RESTARTS)."""
    run_args = (*TINY_RUN, "--output_dir", str(output_dir), *args)
    if via_node_script:
        command, env = node_script_command(config, *run_args)
        env |= {"MAX_RESTARTS": str(restarts)} if restarts else {}
    else:
        command, env = launch_command(config, "train.py", *run_args,
                                      launcher_args=("--max_restarts", str(restarts)) if restarts else ())
    env.pop("PET_SHUTDOWN_TIMEOUT", None)  # whatever the caller's shell says
    if shutdown_timeout:  # a loaded machine may need more than torchrun's 30 s to save after a signal
        env["PET_SHUTDOWN_TIMEOUT"] = shutdown_timeout
    output_dir.mkdir(parents=True, exist_ok=True)
    assert FORKED or not fork_ranks, "fork_ranks forks the ranks of a forked launch: mark the test `forked`"
    if FORKED and not via_node_script:
        return forked_launcher.start(command[len(LAUNCHER):], env, REPO, output_dir / "launch.log", fork_ranks=fork_ranks)
    with (output_dir / "launch.log").open("w") as log:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def flag_refusal(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """The one-line ArgumentError that `parse_args(args)` raises under the launcher environment `env`."""
    from training.arguments import parse_args
    from training.errors import ArgumentError

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError) as refused:
        parse_args(args)
    assert "\n" not in str(refused.value)
    return str(refused.value)


def wait_for(condition: Callable[[], object], seconds: float, what: str | Callable[[], str], poll: float = 0.2) -> None:
    """`what`: what is awaited, for the failure message (a function: read when it fails)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(poll)


def rank_processes(launcher: subprocess.Popen | forked_launcher.Launcher) -> dict[int, psutil.Process]:
    """The train.py processes under a launcher, by global rank (new interpreters, or forked: `start`)."""
    found = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if (rank := forked_launcher.forked_rank(child.pid)) is not None:
                found[rank] = child
            elif "train.py" in " ".join(child.cmdline()):
                found[int(child.environ().get("RANK", "0"))] = child
        except psutil.Error:
            continue
    return found


def logged_loss_steps(output_dir) -> int:
    """The last step whose training loss the run has logged so far (0 before the first)."""
    metrics = output_dir / "metrics.jsonl"
    complete = metrics.read_text().split("\n")[:-1] if metrics.exists() else []  # not a line still being written
    return max((record["step"] for record in map(json.loads, complete) if "loss" in record), default=0)


def signal_pending(process: psutil.Process) -> bool:
    """Whether a (stopped) process has a signal waiting to be handled: /proc's pending masks, shared and its own."""
    status = Path(f"/proc/{process.pid}/status").read_text()
    return any(int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("ShdPnd:", "SigPnd:")))


def freeze(processes) -> None:
    """SIGSTOP each process and wait until every one has stopped: a signal sent to a rank not yet stopped (its SIGSTOP
    still pending) is delivered first, lower-numbered, and handled, never seen pending (SIGTERM: a rare failure)."""
    processes = list(processes)
    for process in processes:
        process.suspend()
    wait_for(lambda: all(process.status() == psutil.STATUS_STOPPED for process in processes), 60, "the ranks to stop",
             poll=0.001)


def signal_states(launcher, ranks: dict[int, psutil.Process]) -> str:
    """The signal masks and states of a launcher and its ranks, and the launcher's processes, for a failure message."""
    def state(pid: int) -> str:
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            return f"{pid}: gone"
        return f"{pid}: " + " ".join(f"{key} {fields[key].strip()}" for key in
                                     ("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))

    children = [f"{child.pid} (rank record {forked_launcher.forked_rank(child.pid)})"
                for child in psutil.Process(launcher.pid).children(recursive=True)]
    return "; ".join([f"launcher {state(launcher.pid)}", *(f"rank {rank} {state(process.pid)}" for rank, process
                                                            in ranks.items()), f"its processes {children}"])


def stop_after_step(launcher, output_dir: Path, step: int, sig: int, processes: int = 2, to_rank_1: bool = False) -> None:
    """Once `step` is logged, freeze the ranks, send `sig` to the launcher (or to rank 1 alone), let them go on,
    and wait for the launcher to fail and its ranks to end; nothing outlives a failed test."""
    ranks = {}
    try:
        wait_for(lambda: len(rank_processes(launcher)) == processes, 120, "the ranks to start")
        ranks = rank_processes(launcher)
        wait_for(lambda: logged_loss_steps(output_dir) >= step, 120, f"step {step} logged", poll=0.005)
        freeze(ranks.values())
        (ranks[1] if to_rank_1 else psutil.Process(launcher.pid)).send_signal(sig)
        if not to_rank_1:  # through a launcher (forwarded, or as its parent's death): resumed once a rank holds
            # it, or a single process's steps, faster than a launcher's death, would train on to the end
            wait_for(lambda: any(map(signal_pending, ranks.values())), 120,
                     lambda: f"the signal to reach a rank ({signal_states(launcher, ranks)})", poll=0.005)
        for rank in ranks.values():
            rank.resume()
        assert launcher.wait(timeout=120) != 0
        psutil.wait_procs(list(ranks.values()), timeout=120)  # a rank whose launcher died finishes its save
    finally:
        end_launch(launcher, ranks.values())


def end_launch(launcher, ranks) -> None:
    """After a test that signals or freezes ranks: kill the ranks still running, then the launcher's session."""
    for rank in ranks:
        if rank.is_running():
            rank.kill()
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)


def made_once(directory: Path, make: Callable[[Path], None]) -> Path:
    """`directory`, filled by `make` once per test run, by whichever worker asks first (the other waits)."""
    with FileLock(f"{directory}.lock"):
        if not (directory / ".complete").exists():
            shutil.rmtree(directory, ignore_errors=True)  # what a failed attempt left
            directory.mkdir(parents=True)
            make(directory)
            (directory / ".complete").touch()
    return directory


def variable_length_documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [doc.split() for doc in generate_documents(count, seed)]
    return [" ".join(doc[: rng.randint(3, 40)]) for doc in words]


def split_args(uneven_data: list[str], per_device: int, accumulation: int, save_steps: int = 4) -> tuple[str, ...]:
    """A run over `uneven_data` with one global batch split as asked; checkpoints every `save_steps`."""
    return (*uneven_data, "--max_steps", str(MAX_STEPS), "--logging_steps", "1", "--eval_steps", "5",
            "--save_steps", str(save_steps), "--per_device_train_batch_size", str(per_device),
            "--gradient_accumulation_steps", str(accumulation))


TRACKED_RUN = "tracked"  # --run_name of `tracked_run_args`


def tracked_run_args(uneven_data: list[str]) -> tuple[str, ...]:
    """2-process DDP over `uneven_data` (4 x 1, 10 steps, eval every 5), checkpoints at steps 5 and 10, TensorBoard
    on: test_tracking's run."""
    return (*split_args(uneven_data, per_device=4, accumulation=1, save_steps=5), "--report_to", "tensorboard",
            "--run_name", TRACKED_RUN, *SHOWN_FLAGS)


def split_run_args(uneven_data: list[str], name: str) -> tuple[str, ...]:
    """The flags of SPLITS entry `name`'s run (to continue it)."""
    _, per_device, accumulation = SPLITS[name]
    return split_args(uneven_data, per_device, accumulation)


STRATEGY_CLIPPING = 0.5  # below these steps' gradient norms: clipping triggers
GLOBAL_BATCH = 12


def validation_batches(output_dir: Path, task: str = "causal-lm") -> list[dict[str, torch.Tensor]]:
    """The batches a run of `task` evaluates (TINY_RUN's first EVAL_SAMPLES held-out sequences, or
    conversations for sft), built by the task itself from the same flags."""
    from contextlib import nullcontext

    from training.arguments import parse_args
    from training.task_registry import build_task

    model_args, data_args, _ = parse_args([*TINY_RUN, "--task", task, "--output_dir", str(output_dir)])
    task = build_task(model_args, data_args)
    raw = task.load_raw_datasets(seed=42)
    task.build_model(raw)
    _, eval_set = task.datasets(raw, nullcontext())
    assert len(eval_set) == EVAL_SAMPLES
    return [task.collator([eval_set[i] for i in range(start, min(start + 8, len(eval_set)))])
            for start in range(0, len(eval_set), 8)]


@torch.no_grad()
def target_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean loss over the target tokens of `batches` (an SFT run's: the answers): what evaluation reports as eval_loss."""
    from training.loss import token_loss_sums

    sums = [token_loss_sums(model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask")).logits, b["labels"])
            for b in batches]
    return float(sum(s.sum() for s, _ in sums) / sum(c.sum() for _, c in sums))


def parity_args(config: str, base_model: Path) -> tuple[str, ...]:
    """Full fine-tuning of `base_model` (the core's causal LM, on the story corpus): 12 steps with a global batch
    of 12 and not one default left: clipping (triggered), accumulation, an odd micro-batch, no decay, warmup by
    ratio, another beta2 and epsilon (1e-6: Adam divides the rare tokens' near-zero embedding gradients by it, and
    at 1e-8 their last-bit differences between strategies grew to 1e-5 in the weights), another seed than the
    base's; the installed parts' `PARITY_FLAGS` (tests/fixtures/<part>.py: parts/ema's average). One process
    accumulates 4 micro-batches of 3; 2
    data-parallel ranks (fsdp_tp: 2 x tp 2) accumulate 2 each. Checkpoints at steps 6 and 12. (Fine-tuning on
    chat data under every config: the LoRA runs, tests/test_fine_tuning.py.)"""
    accumulation = "4" if config == "single" else "2"
    return ("--model_name_or_path", str(base_model), "--seed", "7", "--max_steps", "12",
            "--logging_steps", "1", "--eval_steps", "6", "--save_steps", "6", "--per_device_train_batch_size", "3",
            "--gradient_accumulation_steps", accumulation, "--weight_decay", "0", "--warmup_ratio", "0.1",
            "--adam_beta2", "0.99", "--adam_epsilon", "1e-6", "--max_grad_norm", str(STRATEGY_CLIPPING), *PARITY_FLAGS)



def assert_public_api_only(part: str) -> None:
    """parts/<part> is written as a forker writes a part (issue 70): of this template it imports `training.parts`, the
    errors and the shares API alone (no core edit needed), and no private name."""
    imported = set()
    for path in sorted((REPO / "parts" / part).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {(alias.name, "") for alias in node.names}
    core = {module for module, _ in imported if module.split(".")[0] in ("training", "data", "models")}
    assert core <= {"training.parts", "training.errors", "training.strategy.shares"}, (part, core)
    assert not [name for _, name in imported if name.startswith("_")], part
