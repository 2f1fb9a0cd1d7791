"""train.py against what a user would pick instead (`scripts/benchmark.py --peers`): transformers' `Trainer` on the
same model, data, batch, schedule and step budget (scripts/trainer_peer.py), on one process and on DDP with 2, in
alternating rounds; each row is one round's tokens/s and eval loss, the ratios train.py over Trainer, then the
medians."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER_DEFAULTS = {"model_config": "llama-tiny", "per_device_train_batch_size": 8, "block_size": 128, "steps": 150,
                 "warmup": 5, "log_every": 5, "mixed_precision": "no"}  # the settings issue 64's trial ran
EVAL_SAMPLES = 256


def train_py_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """train.py at its defaults but for what both runs share: model, batch, steps, the linear schedule, one
    evaluation at the end on the same blocks."""
    return ("--model_config", args.model_config, "--per_device_train_batch_size", str(args.per_device_train_batch_size),
            "--block_size", str(args.block_size), "--max_steps", str(args.steps), "--lr_scheduler_type", "linear",
            "--warmup_steps", str(max(1, args.steps // 10)), "--logging_steps", str(args.log_every),
            "--eval_steps", str(args.steps), "--eval_on_start", "false", "--save_strategy", "no",
            "--max_eval_samples", str(EVAL_SAMPLES))


def trainer_run(args: argparse.Namespace, processes: int, environment: dict[str, str], free_port: Callable[[], int]
                ) -> dict:
    """scripts/trainer_peer.py on `processes` (torchrun for DDP): its JSON line."""
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                str(free_port())] if processes > 1 else []
    command = [sys.executable, *launcher, "scripts/trainer_peer.py", "--model_config", args.model_config,
               "--per_device_train_batch_size", str(args.per_device_train_batch_size), "--block_size",
               str(args.block_size), "--steps", str(args.steps), "--warmup", str(args.warmup), "--max_eval_samples",
               str(EVAL_SAMPLES), *(["--bf16"] if args.mixed_precision == "bf16" else [])]
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"error: trainer_peer.py failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def peers_table(args: argparse.Namespace, scratch: Path, train_run: Callable, environment: dict[str, str],
                free_port: Callable[[], int]) -> tuple[list[str], dict]:
    """Alternating rounds of train.py and Trainer, on 1 and 2 processes; the ratios' medians."""
    rows, results = [], {"rounds": []}
    for round_ in range(args.rounds):
        for processes in (1, 2):
            ours = train_run("ddp", args, scratch / f"peers{round_}-{processes}", train_py_flags(args), processes)
            # the statistic trainer_peer.py reports: tokens / time over the steps after warm-up
            rate = len(ours["intervals"]) / sum(1 / m["tokens_per_sec"] for m in ours["intervals"])
            theirs = trainer_run(args, processes, environment, free_port)
            results["rounds"].append({"processes": processes, "train_py": rate, "train_py_eval_loss": ours["eval_loss"],
                                      "trainer": theirs["tokens_per_sec"], "trainer_eval_loss": theirs["eval_loss"],
                                      "trainer_parallel_mode": theirs["parallel_mode"]})
            rows.append(f"| {round_ + 1} | {processes} | {rate:,.0f} | {theirs['tokens_per_sec']:,.0f} | "
                        f"{rate / theirs['tokens_per_sec']:.3f} | {ours['eval_loss']:.4f} | {theirs['eval_loss']:.4f} | "
                        f"{ours['eval_loss'] / theirs['eval_loss']:.3f} |")
            print(rows[-1], flush=True)
    lines = [f"model {args.model_config}, {args.per_device_train_batch_size} x {args.block_size} tokens per process "
             f"per step, {args.steps} steps, AdamW, linear schedule, {args.mixed_precision}; train.py at its defaults "
             "against transformers' Trainer at its own", "",
             "| round | processes | train.py (tokens/s) | Trainer (tokens/s) | ratio | train.py eval loss | "
             "Trainer eval loss | ratio |", "|---:|---:|---:|---:|---:|---:|---:|---:|", *rows]
    for processes in (1, 2):
        runs = [r for r in results["rounds"] if r["processes"] == processes]
        speed = statistics.median(r["train_py"] / r["trainer"] for r in runs)
        loss = statistics.median(r["train_py_eval_loss"] / r["trainer_eval_loss"] for r in runs)
        results[f"median_{processes}"] = {"speed_ratio": speed, "eval_loss_ratio": loss}
        lines.append(f"| median | {processes} | | | **{speed:.3f}** | | | {loss:.3f} |")
    return lines, results
