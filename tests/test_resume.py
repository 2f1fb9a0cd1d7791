"""Checkpoints resume exactly where they left off and rotate; a rank killed mid-run (mid-save: that save never counts)
is restarted by torchrun and the run ends as if it had not crashed; a non-finite loss stops before any save."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import (
    MAX_STEPS,
    REPO,
    SPLIT_OF,
    SPLITS,
    TINY_RUN,
    assert_continues_exactly,
    bad_input_errors,
    end_launch,
    free_port,
    freeze,
    launch,
    logged_loss_steps,
    rank_processes,
    read_metrics,
    split_args,
    split_run_args,
    start,
    train,
    wait_for,
)
from training.checkpoints.files import complete_checkpoints, file_sha256
from training.checkpoints.tensors import MODEL_STATE
from training.parts import installed

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

RESUME_STEP = 8  # mid-epoch, in the second epoch (6 steps per epoch on `uneven_data`)
# The other configs resume the same way in test_preemption.py (parts/preemption), from a stop in the second epoch.
if installed("preemption"):
    from tests.test_preemption import CASES as STOP_CASES
else:
    STOP_CASES = {}
RESUMED_AFTER_A_STOP = {config for config, *_ in STOP_CASES.values()}


@pytest.mark.parametrize("config", sorted(set(SPLIT_OF) - RESUMED_AFTER_A_STOP))
def test_resume_latest_in_a_fresh_launch_continues_exactly(config, split_run, uneven_data, tmp_path) -> None:
    args = split_run_args(uneven_data, SPLIT_OF[config])  # the global batch of 8, split as that config's run
    full = split_run(SPLIT_OF[config])
    shutil.copytree(full / "checkpoints" / f"step_{RESUME_STEP}", tmp_path / "checkpoints" / f"step_{RESUME_STEP}")

    result = train(config, tmp_path, *args, "--resume_from_checkpoint", "latest")
    assert f"at step {RESUME_STEP}" in result.stderr
    assert_continues_exactly(full, tmp_path, RESUME_STEP)


def cut_short(file: Path, runs: Callable[[str], Path]) -> None:
    file.write_bytes(file.read_bytes()[:1000])


def of_step_4(file: Path, runs: Callable[[str], Path]) -> None:
    shutil.copy(runs("this") / "checkpoints" / "step_4" / MODEL_STATE / file.name, file)


def of_another_run(file: Path, runs: Callable[[str], Path]) -> None:
    shutil.copy(runs("another") / "checkpoints" / "step_6" / MODEL_STATE / file.name, file)


def manifest_deleted(file: Path, runs: Callable[[str], Path]) -> None:
    (file.parents[1] / "manifest.json").unlink()


def manifest_emptied(file: Path, runs: Callable[[str], Path]) -> None:
    (file.parents[1] / "manifest.json").write_text("{}")


def of_another_run_manifest_edited(file: Path, runs: Callable[[str], Path]) -> None:
    """Another run's rank file, and the manifest's size and SHA-256 of it edited to match: only the file's own stamp
    tells."""
    of_another_run(file, runs)
    manifest = json.loads((file.parents[1] / "manifest.json").read_text())
    manifest["files"][f"{MODEL_STATE}/{file.name}"] |= {"bytes": file.stat().st_size, "sha256": file_sha256(file)}
    (file.parents[1] / "manifest.json").write_text(json.dumps(manifest))


# What a resume refuses in one line on every rank, nothing trained: damage the size shows (before the process group),
# a rank file of another run or step that only its bytes show (FSDP2's shards of one model are the same size in every
# checkpoint: each rank checks its share of the files after `prepare`), another model of the same shapes (an
# activation, a norm epsilon). name -> (split run, the file changed and how, train.py's flags added, the line's
# start after the checkpoint's path)
REFUSED = {
    "rank0.safetensors missing": ("2x4x1", "rank0.safetensors", lambda file, runs: file.unlink(), (),
                                  "/model_state/rank0.safetensors is missing"),
    "rank1.safetensors cut short": ("2x4x1", "rank1.safetensors", cut_short, (),
                                    "/model_state/rank1.safetensors is damaged (1,000 bytes, saved as "),
    "fsdp, rank1.safetensors of step 4": ("fsdp-2x2x2", "rank1.safetensors", of_step_4, (),
                                          "/model_state/rank1.safetensors was saved at step 4, this checkpoint at step 8"),
    "fsdp, rank1.safetensors of another run": ("fsdp-2x2x2", "rank1.safetensors", of_another_run, (),
                                               "/model_state/rank1.safetensors belongs to run "),
    "zero3, manifest.json deleted": ("zero3-2x4x1", "rank0.safetensors", manifest_deleted, (),
                                     " has no manifest.json, so nothing proves its files whole and of one run; resume a "
                                     "checkpoint saved with its manifest, or this one unchecked on purpose with "
                                     "--resume_unchecked"),
    "zero3, rank1.safetensors of another run, the manifest edited to match": (
        "zero3-2x4x1", "rank1.safetensors", of_another_run_manifest_edited, (),
        "/model_state/rank1.safetensors belongs to run "),
    "fsdp, manifest.json emptied": ("fsdp-2x2x2", "rank0.safetensors", manifest_emptied, (),
                                    "/manifest.json does not list trainer_state.json, which every save lists"),
    "fsdp, another activation and norm epsilon": (
        "fsdp-2x2x2", None, None, ("--config_overrides", "hidden_act=gelu,rms_norm_eps=0.1"),
        " holds a model configured otherwise: hidden_act ('silu' -> 'gelu'), rms_norm_eps (1e-06 -> 0.1); resume with "
        "the flags it was trained with, or name the fields you change on purpose (shapes must still match): "
        "--allow_config_changes hidden_act,rms_norm_eps"),
}


@pytest.mark.parametrize("refused", REFUSED)
def test_a_checkpoint_damaged_of_another_step_or_model_stops_every_rank_in_one_line(
        refused, split_run, strategy_run, uneven_data, tmp_path) -> None:
    """Before, a missing rank file was a KeyError and a truncated one safetensors' traceback (issue 54); a rank file
    of another run (the same model under fsdp.yaml, the suite's parity run) or step the size of this one's, and a
    model of other settings but the same shapes, resumed with exit 0 and trained on the wrong state (issue 62)."""
    name, file, damage, flags, message = REFUSED[refused]
    run, copy = split_run(name), tmp_path / "checkpoints" / f"step_{RESUME_STEP}"
    shutil.copytree(run / "checkpoints" / f"step_{RESUME_STEP}", copy)
    if damage:
        foreign = "deepspeed_zero3" if name.startswith("zero3") else "fsdp"  # (the suite's parity run of that config)
        damage(copy / MODEL_STATE / file, lambda which: run if which == "this" else strategy_run(foreign))
    result = launch(SPLITS[name][0], "train.py", *TINY_RUN, "--output_dir", str(tmp_path), *split_run_args(uneven_data, name),
                    *flags, "--resume_from_checkpoint", "latest")
    errors = bad_input_errors(result)
    assert len(errors) == 1 and errors[0].startswith(f"error: {copy}{message}"), errors
    assert not (tmp_path / "metrics.jsonl").exists()


def test_rotation_keeps_the_newest_checkpoints(tmp_path) -> None:
    train("single", tmp_path, "--max_steps", "8", "--eval_steps", "100", "--save_steps", "2", "--save_total_limit", "3")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4", "step_6", "step_8"]


# A crashed rank, restarted without a person: `accelerate launch --max_restarts 1` (the config's static rendezvous),
# killed in the middle of a save (with --save_total_limit 1), and the SLURM node script (c10d rendezvous,
# MAX_RESTARTS=1) under a sharded config. config -> (through the node script, killed mid-save)
RESTARTS = {"ddp": (False, True), "fsdp": (True, False)}


@pytest.mark.parametrize("config", RESTARTS)
def test_a_rank_killed_mid_run_is_restarted_and_the_run_ends_as_if_it_had_not_crashed(
    config, split_run, uneven_data, tmp_path
) -> None:
    """kill -9 of rank 1 (ddp: while a save is half written, which then never counts, and rotation has kept the
    checkpoint before it): torchrun restarts every rank, they resume the last complete checkpoint
    (`--resume_from_checkpoint latest`, which the first launch, with none, ignores), the launch exits 0 and the run
    logged the uninterrupted one's losses."""
    node_script, mid_save = RESTARTS[config]
    uninterrupted, (_, per_device, accumulation) = split_run(SPLIT_OF[config]), SPLITS[SPLIT_OF[config]]
    saving = ("--save_steps", "1", "--save_total_limit", "1") if mid_save else ()
    launcher = start(config, tmp_path, *split_args(uneven_data, per_device, accumulation), *saving,
                     "--resume_from_checkpoint", "latest", via_node_script=node_script, restarts=1)
    checkpoints, ranks = tmp_path / "checkpoints", {}

    def frozen_mid_save() -> bool:
        """Freeze both ranks; keep them frozen only if a save is in progress that rank 1 has not written its part of
        (past that, rank 0 may complete it alone: the save would count)."""
        freeze(ranks.values())
        if any(not (staging / MODEL_STATE / "rank1.safetensors").exists() for staging in checkpoints.glob("*.tmp")):
            return True
        for rank in ranks.values():
            rank.resume()
        return False

    try:
        wait_for(lambda: len(rank_processes(launcher)) == 2, 120, "the ranks to start")
        ranks = rank_processes(launcher)
        if mid_save:
            wait_for(lambda: complete_checkpoints(str(tmp_path)), 120, "a first checkpoint", poll=0.005)
            wait_for(frozen_mid_save, 60, "a save in progress", poll=0.003)
            (half_written,) = checkpoints.glob("*.tmp")
            resumed_at = int(half_written.name.removeprefix("step_").removesuffix(".tmp")) - 1
            # the previous checkpoint is complete and rotation (limit 1) did not remove it
            assert [p.name for p in complete_checkpoints(str(tmp_path))] == [f"step_{resumed_at}"]
        else:
            wait_for(lambda: logged_loss_steps(tmp_path) >= 5, 120, "step 5 logged", poll=0.005)
        ranks[1].kill()
        for rank in ranks.values():
            if rank.is_running():
                rank.resume()
        assert launcher.wait(timeout=300) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    finally:
        end_launch(launcher, ranks.values())
    resumed = re.search(r"resumed from .*step_(\d+) at step (\d+)", (tmp_path / "launch.log").read_text())
    assert resumed and (int(resumed.group(2)) == resumed_at if mid_save else int(resumed.group(2)) in (4, 8))
    if mid_save:  # the half-written save was done again, and rotated away with the others
        assert [p.name for p in checkpoints.iterdir()] == [f"step_{MAX_STEPS}"]
    assert_continues_exactly(uninterrupted, tmp_path, 0)


# rank -> TORCHELASTIC_RESTART_COUNT (None: not under torchrun) of the ranks started
NEVER_MEET = {
    # on two machines under static rendezvous only the failed machine's workers restart: two rounds never meet
    "peers in another round": {0: "1", 1: "0"},
    "the store's host never started": {1: None},  # rank 0, which hosts the store, died (outside torchrun's agent)
}


@pytest.mark.parametrize("ranks", NEVER_MEET.values(), ids=NEVER_MEET)
def test_ranks_that_never_all_meet_fail_in_one_line_within_the_ddp_timeout(ranks, tmp_path) -> None:
    """Neither hangs nor prints a traceback: each rank names itself, the store and --ddp_timeout, and exits 4."""
    port, timeout_s = free_port(), 5
    started = time.monotonic()
    processes = {rank: subprocess.Popen(
        [sys.executable, "train.py", *TINY_RUN, "--output_dir", str(tmp_path), "--ddp_timeout", str(timeout_s)],
        cwd=REPO, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={key: value for key, value in os.environ.items() if key != "TORCHELASTIC_RESTART_COUNT"} | {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", **({"TORCHELASTIC_RESTART_COUNT": attempt} if attempt else {})},
    ) for rank, attempt in ranks.items()}
    try:
        for rank, process in processes.items():
            _, stderr = process.communicate(timeout=120)
            errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
            assert process.returncode == 4 and "Traceback" not in stderr, stderr[-3000:]
            restart = f", torchrun restart {ranks[rank]}" if ranks[rank] else ""
            assert errors == [f"error: rank {rank} waited more than --ddp_timeout {timeout_s}s for all 2 ranks to start "
                              f"the process group (store 127.0.0.1:{port}{restart}): a rank died or never started; "
                              "check the other ranks' logs, and restart a job of several machines with c10d rendezvous "
                              "(--rdzv_backend c10d, as scripts/slurm/launch_node.sh does)"]
    finally:
        for process in processes.values():
            process.kill()
    assert time.monotonic() - started < timeout_s + 60  # the timeout, and each rank's start-up (imports: seconds)
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_non_finite_loss_stops_the_run_before_anything_is_saved(tmp_path) -> None:
    """A learning rate of 1e4 without clipping breaks the tiny model within a few steps."""
    result = launch("ddp", "train.py", "--model_config", "llama-tiny", "--output_dir", str(tmp_path),
                    "--max_steps", "12", "--logging_steps", "1", "--save_steps", "1", "--learning_rate", "1e4",
                    "--max_grad_norm", "0", "--warmup_steps", "0", "--lr_scheduler_type", "constant")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "non-finite (NaN or inf) at step" in errors[0], result.stderr[-3000:]
    bad_step = int(errors[0].split("at step ")[1].split(";")[0])
    logged = [m["loss"] for m in read_metrics(tmp_path) if "loss" in m]
    assert len(logged) == bad_step - 1 and all(map(math.isfinite, logged))  # nothing logged from the bad step on
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved and max(saved) < bad_step  # no checkpoint of poisoned weights
    assert not (tmp_path / "final").exists()


@pytest.mark.quick
def test_nothing_between_restoring_a_checkpoint_and_the_next_step_draws_from_the_global_rng() -> None:
    """Dropout draws from the global RNG, which a checkpoint restores; a resumed run then creates the training
    loader's iterator before its first step, as an uninterrupted run did long before. It may not draw from that
    RNG, or the resumed run's dropout masks differ (measured: a LoRA run with dropout 0.1 resumed off by 3.5e-3 at
    its first step before the loader had a generator of its own; bit-exact after). (parts/mfu's CPU probe: test_mfu.py)"""
    import torch

    from training.setup import training_loader

    state = torch.get_rng_state()
    next(iter(training_loader(list(range(16)), batch_size=4, seed=0)))
    assert torch.equal(torch.get_rng_state(), state)
