"""train.py against what a user would pick instead (`scripts/benchmark.py --peers`), each at its own defaults (its
own threads too), in alternating rounds, then the medians of the ratios:

- transformers' `Trainer` on the same model, data, batch, schedule and step budget (scripts/trainer_peer.py), on one
  process and on DDP with 2: tokens/s over the steps after warm-up, eval loss, and the wall time from launch to exit;
- with `--nanogpt PATH` (a checkout of karpathy/nanoGPT; its code is not copied here), nanoGPT's CPU recipe for
  Shakespeare by character (`NANOGPT_RECIPE`) against train.py at the same shape (`--block_size 65`: its 64-token
  context, see docs/train-py.md), on one process: the median step time after warm-up, and the wall time. The text is
  the default corpus written out as nanoGPT's input.txt (nothing is downloaded), read by both.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER_DEFAULTS = {"model_config": "llama-tiny", "per_device_train_batch_size": 8, "block_size": 128, "steps": 150,
                 "warmup": 5, "log_every": 5, "mixed_precision": "no"}  # the settings issue 64's trial ran
EVAL_SAMPLES = 256
# nanoGPT's README, "I only have a macbook": its CPU recipe (iterations from --nanogpt_steps)
NANOGPT_RECIPE = ("config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                  "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                  "--n_embd=128", "--dropout=0.0")
NANOGPT_CHARACTERS = 1_115_394  # as many as its tiny Shakespeare
NANOGPT_STEP = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.MULTILINE)
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)", re.MULTILINE)


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
    """scripts/trainer_peer.py on `processes` (torchrun for DDP): its JSON line, and the wall time."""
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                str(free_port())] if processes > 1 else []
    command = [sys.executable, *launcher, "scripts/trainer_peer.py", "--model_config", args.model_config,
               "--per_device_train_batch_size", str(args.per_device_train_batch_size), "--block_size",
               str(args.block_size), "--steps", str(args.steps), "--warmup", str(args.warmup), "--max_eval_samples",
               str(EVAL_SAMPLES), *(["--bf16"] if args.mixed_precision == "bf16" else [])]
    launched = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        sys.exit(f"error: trainer_peer.py failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1]) | {"launch_to_exit": time.perf_counter() - launched}


def steady_rate(run: dict) -> float:
    """train.py's tokens/s over the logged intervals after warm-up, as trainer_peer.py reports its own: tokens over
    time (the intervals hold equal tokens)."""
    return len(run["intervals"]) / sum(1 / m["tokens_per_sec"] for m in run["intervals"])


def peers_table(args: argparse.Namespace, scratch: Path, train_run: Callable, environment: dict[str, str],
                free_port: Callable[[], int]) -> tuple[list[str], dict]:
    """Alternating rounds of train.py and Trainer, on 1 and 2 processes (then of train.py and nanoGPT, given
    --nanogpt); the ratios' medians."""
    rows, results = [], {"rounds": []}
    for round_ in range(args.rounds):
        for processes in (1, 2):
            ours = train_run("ddp", args, scratch / f"peers{round_}-{processes}", train_py_flags(args), processes)
            theirs = trainer_run(args, processes, environment, free_port)
            results["rounds"].append({
                "processes": processes, "train_py": steady_rate(ours), "train_py_eval_loss": ours["eval_loss"],
                "train_py_wall_s": ours["launch_to_exit"], "train_py_compiled": ours.get("torch_compile"),
                "trainer": theirs["tokens_per_sec"], "trainer_eval_loss": theirs["eval_loss"],
                "trainer_wall_s": theirs["launch_to_exit"], "trainer_parallel_mode": theirs["parallel_mode"]})
            rows.append(trainer_row(round_, results["rounds"][-1]))
            print(rows[-1], flush=True)
    lines = [f"model {args.model_config}, {args.per_device_train_batch_size} x {args.block_size} tokens per process "
             f"per step, {args.steps} steps, AdamW, linear schedule, {args.mixed_precision}; train.py at its defaults "
             "against transformers' Trainer at its own", "",
             "| round | processes | train.py (tokens/s) | Trainer (tokens/s) | ratio | train.py eval loss | "
             "Trainer eval loss | ratio | train.py wall (s) | Trainer wall (s) | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows]
    for processes in (1, 2):
        runs = [r for r in results["rounds"] if r["processes"] == processes]
        ratios = {name: statistics.median(r[ours] / r[theirs] for r in runs) for name, ours, theirs in (
            ("speed_ratio", "train_py", "trainer"), ("eval_loss_ratio", "train_py_eval_loss", "trainer_eval_loss"),
            ("wall_ratio", "train_py_wall_s", "trainer_wall_s"))}
        results[f"median_{processes}"] = ratios
        lines.append(f"| median | {processes} | | | **{ratios['speed_ratio']:.3f}** | | | "
                     f"{ratios['eval_loss_ratio']:.3f} | | | {ratios['wall_ratio']:.3f} |")
    if args.nanogpt:
        more, results["nanogpt"] = nanogpt_table(args, scratch, train_run, environment)
        lines += ["", *more]
    return lines, results


def trainer_row(round_: int, run: dict) -> str:
    compiled = " (compiled)" if run["train_py_compiled"] else ""
    return (f"| {round_ + 1} | {run['processes']} | {run['train_py']:,.0f}{compiled} | {run['trainer']:,.0f} | "
            f"{run['train_py'] / run['trainer']:.3f} | {run['train_py_eval_loss']:.4f} | {run['trainer_eval_loss']:.4f} | "
            f"{run['train_py_eval_loss'] / run['trainer_eval_loss']:.3f} | {run['train_py_wall_s']:.1f} | "
            f"{run['trainer_wall_s']:.1f} | {run['train_py_wall_s'] / run['trainer_wall_s']:.3f} |")


def nanogpt_checkout(source: Path, scratch: Path) -> tuple[Path, Path]:
    """A copy of nanoGPT's checkout in `scratch` with the default corpus as its Shakespeare input.txt, prepared by
    its own prepare.py (which downloads only when input.txt is missing); the checkout and the text file."""
    if not (source / "train.py").is_file() or not (source / "data" / "shakespeare_char" / "prepare.py").is_file():
        sys.exit(f"error: --nanogpt {source} is not a checkout of karpathy/nanoGPT (no train.py and "
                 "data/shakespeare_char/prepare.py): git clone https://github.com/karpathy/nanoGPT and pass its path")
    from data.default_corpus import default_splits

    checkout = scratch / "nanoGPT"
    shutil.copytree(source, checkout, ignore=shutil.ignore_patterns(".git", "out*"))
    text = checkout / "data" / "shakespeare_char" / "input.txt"
    text.write_text("\n\n".join(default_splits()["train"])[:NANOGPT_CHARACTERS])
    subprocess.run([sys.executable, "prepare.py"], cwd=text.parent, check=True, capture_output=True, timeout=600)
    return checkout, text


def nanogpt_run(args: argparse.Namespace, checkout: Path, environment: dict[str, str]) -> dict:
    """nanoGPT's train.py at its CPU recipe: the median step time after warm-up, its last val loss, the wall time."""
    command = [sys.executable, "train.py", *NANOGPT_RECIPE, f"--max_iters={args.nanogpt_steps}",
               f"--lr_decay_iters={args.nanogpt_steps}", f"--out_dir={checkout / 'out'}"]
    launched = time.perf_counter()
    result = subprocess.run(command, cwd=checkout, env=environment, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        sys.exit(f"error: nanoGPT's train.py failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    steps = [float(ms) / 1000 for step, ms in NANOGPT_STEP.findall(result.stdout) if int(step) > args.warmup]
    evaluations = NANOGPT_EVAL.findall(result.stdout)
    return {"step_time": statistics.median(steps), "val_loss": float(evaluations[-1][1]),
            "launch_to_exit": time.perf_counter() - launched}


def nanogpt_table(args: argparse.Namespace, scratch: Path, train_run: Callable, environment: dict[str, str]
                  ) -> tuple[list[str], dict]:
    """Alternating rounds of nanoGPT's CPU recipe and train.py at its defaults on the same shape and text."""
    checkout, text = nanogpt_checkout(args.nanogpt, scratch)
    flags = ("--train_file", str(text), "--model_config", "llama-small", "--config_overrides", "hidden_size=128",
             "--block_size", "65", "--per_device_train_batch_size", "12", "--max_steps", str(args.nanogpt_steps),
             "--logging_steps", str(args.log_every), "--eval_steps", str(args.nanogpt_steps), "--save_strategy", "no")
    rounds, rows = [], []
    for round_ in range(args.rounds):
        ours = train_run("ddp", args, scratch / f"nanogpt-shape{round_}", flags, 1)
        theirs = nanogpt_run(args, checkout, environment)
        rounds.append({"train_py_step_time": ours["step_time"], "train_py_compiled": ours.get("torch_compile"),
                       "train_py_eval_loss": ours["eval_loss"], "train_py_wall_s": ours["launch_to_exit"],
                       "nanogpt_step_time": theirs["step_time"], "nanogpt_val_loss": theirs["val_loss"],
                       "nanogpt_wall_s": theirs["launch_to_exit"]})
        run = rounds[-1]
        rows.append(f"| {round_ + 1} | {run['train_py_step_time'] * 1000:.2f}"
                    f"{' (compiled)' if run['train_py_compiled'] else ''} | {run['nanogpt_step_time'] * 1000:.2f} | "
                    f"{run['train_py_step_time'] / run['nanogpt_step_time']:.3f} | {run['train_py_eval_loss']:.4f} | "
                    f"{run['nanogpt_val_loss']:.4f} | {run['train_py_wall_s']:.1f} | {run['nanogpt_wall_s']:.1f} |")
        print(rows[-1], flush=True)
    step_ratio = statistics.median(r["train_py_step_time"] / r["nanogpt_step_time"] for r in rounds)
    wall_ratio = statistics.median(r["train_py_wall_s"] / r["nanogpt_wall_s"] for r in rounds)
    bare = bare_model_steps(checkout)
    lines = [f"nanoGPT's CPU recipe ({args.nanogpt_steps} iterations; 4 layers x 128, context 64, batch 12) against "
             "train.py at its defaults on that shape (llama-small at hidden_size=128, --block_size 65, the shipped "
             "tokenizer), one process, the default corpus as the text", "",
             "| round | train.py step (ms) | nanoGPT step (ms) | ratio | train.py eval loss (per token) | "
             "nanoGPT val loss (per character) | train.py wall (s) | nanoGPT wall (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|", *rows,
             f"| median | | | **{step_ratio:.3f}** | | | wall ratio {wall_ratio:.3f} | |", "",
             "The two models alone, in one bare loop (forward, backward, clipping, fused AdamW; no data loading, "
             "logging or schedule): the step each model itself costs at this shape", "",
             "| model | eager step (ms) | compiled step (ms) |", "|---|---:|---:|",
             *(f"| {name} | {times['eager'] * 1000:.2f} | {times['compiled'] * 1000:.2f} |" for name, times in bare.items())]
    return lines, {"rounds": rounds, "step_time_ratio": step_ratio, "wall_ratio": wall_ratio, "bare_models": bare}


def bare_model_steps(checkout: Path, steps: int = 60, warmup: int = 10) -> dict[str, dict[str, float]]:
    """The median step of nanoGPT's GPT (its model.py, at its recipe) and of the template's model at that shape (the
    shipped tokenizer's vocabulary), eager and compiled, in one bare loop in this process: what bounds train.py's
    step against nanoGPT's when the loop around it costs nothing."""
    import torch

    sys.path.insert(0, str(checkout))
    from model import GPT, GPTConfig  # nanoGPT's

    from models.configs import build_named_config
    from models.language import build_tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(None, None)
    template = AutoModelForCausalLM.from_config(build_named_config("llama-small", tokenizer, "hidden_size=128"))
    characters = pickle.loads((checkout / "data" / "shakespeare_char" / "meta.pkl").read_bytes())["vocab_size"]
    nanogpt = GPT(GPTConfig(block_size=64, vocab_size=characters, n_layer=4, n_head=4, n_embd=128, dropout=0.0,
                            bias=False))
    losses = {
        f"nanoGPT's GPT (vocabulary {characters})": (nanogpt, characters, lambda model, x, y: model(x, y)[1]),
        f"the template's llama-small at hidden_size=128 (vocabulary {template.config.vocab_size})": (
            template, template.config.vocab_size, lambda model, x, y: torch.nn.functional.cross_entropy(
                model(input_ids=x).logits.flatten(0, 1), y.flatten()))}
    times = {}
    for name, (model, vocabulary, loss_of) in losses.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        x, y = torch.randint(0, vocabulary, (12, 64)), torch.randint(0, vocabulary, (12, 64))
        for kind, step_loss in (("eager", loss_of), ("compiled", torch.compile(loss_of))):
            seconds = []
            for _ in range(steps):
                start = time.perf_counter()
                step_loss(model, x, y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                seconds.append(time.perf_counter() - start)
            times.setdefault(name, {})[kind] = statistics.median(seconds[warmup:])
    return times
