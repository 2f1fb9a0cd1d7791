"""The MFU table of scripts/benchmark.py (`--mfu`): train.py's model FLOPs utilisation on a shape the field compares.

    python scripts/benchmark.py --mfu                                   # GPU: the figures in docs/gpus.md
    python scripts/benchmark.py --mfu --configs ddp --block_sizes 1024  # fewer rows
    python scripts/benchmark.py --mfu --configs ddp --no_tokenizer_row --train_flags=--use_liger_kernel
    python scripts/benchmark.py --mfu --configs ddp --no_tokenizer_row --eager_only --train_flags=--fused_linear_cross_entropy

- **Model**: the `llama-125m` body (GPT-2 small's: 12 layers, d = 768) with a 50,304-token vocabulary
  (`--config_overrides vocab_size=50304`), as llm.c, modded-nanogpt and nanochat measure it. The data is
  the default corpus: its token ids stay below the shipped tokenizer's 960, and throughput does not depend
  on which ids a batch holds. A last row keeps the tokenizer's own vocabulary: what the default job gives.
- **Batch**: the largest micro-batch up to `--max_micro_batch` that fits (halved after an out-of-memory),
  no accumulation, `--mixed_precision bf16`, fused AdamW (train.py's default `--optim`).
- **Rows**: ddp eager, ddp with `--torch_compile`, fsdp and deepspeed_zero2 (those of `--configs`), at each
  of `--block_sizes` (T), each with `--train_flags` added (a lever: `--use_liger_kernel`, a compile mode).
- **Figures**: medians over train.py's logged intervals after the first (the warm-up: CUDA context,
  autotuning, compilation), `--steps` optimizer steps; each MFU is recomputed here from what train.py
  logged: tokens/s x FLOPs per token (summary.json) / peak FLOP/s (metrics.jsonl). On CPU the shape is
  tiny and the peak is train.py's probe of the CPU's matmul rate.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from collections.abc import Callable
from pathlib import Path

from training.metrics import read_metrics
from training.parts import installed

ROWS = [("ddp", False), ("ddp", True), ("fsdp", False), ("deepspeed_zero2", False)]  # (config, --torch_compile)
ANCHOR_VOCABULARY = 50304  # GPT-2's 50,257 tokens padded to a multiple of 64, as llm.c and modded-nanogpt do
# warmup 0: train_run's own medians (unused here) count every logged step
GPU_DEFAULTS = {"model_config": "llama-125m", "block_sizes": [1024, 2048], "max_micro_batch": 64, "steps": 110,
                "warmup": 0, "log_every": 10, "mixed_precision": "bf16"}
CPU_DEFAULTS = {"model_config": "llama-tiny", "block_sizes": [64, 128], "max_micro_batch": 4, "steps": 12,
                "warmup": 0, "log_every": 2, "mixed_precision": "bf16"}


def steady_figures(run_dir: Path) -> dict:
    """A run's medians over its logged intervals after the first, each MFU recomputed from the logged
    tokens/s and peak FLOP/s and the summary's FLOPs per token."""
    summary = json.loads((run_dir / "summary.json").read_text())
    logged = [m for m in read_metrics(run_dir) if "tokens_per_sec" in m]
    intervals = logged[1:]
    if not intervals:
        raise SystemExit(f"error: {run_dir} logged {len(logged)} interval(s); raise --steps or lower --log_every")
    flops = summary["flops_per_token"]
    return {"tokens_per_sec": statistics.median(m["tokens_per_sec"] for m in intervals),
            "step_time": statistics.median(m["step_time"] for m in intervals),
            "mfu": statistics.median(m["tokens_per_sec"] * flops / m["peak_flops"] for m in intervals),
            "peak_memory_gb": summary["peak_memory_gb"], "final_loss": logged[-1]["loss"], "flops_per_token": flops,
            "whole_run_mfu": summary["mfu"], "train_py_steady_mfu": summary["steady_mfu"],
            "wall_time_s": summary["wall_time_s"], "intervals": intervals,
            "torch_compile": summary.get("torch_compile")}  # what ran (None: a fork without the compile part)


def tokenizer_vocabulary() -> int:
    """The output layer's rows a named config gets from the shipped tokenizer (models/configs.py)."""
    from models.configs import build_named_config
    from models.language import build_tokenizer

    return build_named_config("llama-tiny", build_tokenizer(None, None)).vocab_size


def fitting_run(train_run: Callable, config: str, args: argparse.Namespace, output_dir: Path, flags: tuple) -> dict:
    """train.py at the largest micro-batch from --max_micro_batch down that does not run out of memory."""
    micro_batch = args.max_micro_batch
    while True:
        try:
            train_run(config, args, output_dir, (*flags, "--per_device_train_batch_size", str(micro_batch)))
            return steady_figures(output_dir) | {"micro_batch": micro_batch}
        except SystemExit as failure:
            if "out of memory" not in str(failure).lower() or micro_batch == 1:
                raise
            micro_batch //= 2
            print(f"{config}: out of memory, trying a micro-batch of {micro_batch}", flush=True)


def compiled_by_flags(args: argparse.Namespace) -> bool:
    """--train_flags hold a compile option: every run compiles, so only the compiled rows run."""
    return any(flag.startswith("--torch_compile") for flag in shlex.split(args.train_flags))


def mfu_rows(args: argparse.Namespace) -> list[tuple[str, bool, int | None, int]]:
    """(config, compiled, vocabulary or None for the tokenizer's, T): one per (config, compiled) of ROWS in --configs
    at each --block_sizes, then the first compiled row's setting with the shipped tokenizer's vocabulary."""
    compile_option = compiled_by_flags(args)
    rows = [(config, compiled, ANCHOR_VOCABULARY, length) for length in args.block_sizes
            for config, compiled in ROWS if config in args.configs and (compiled or not compile_option)
            and not (compiled and args.eager_only)  # eager levers (bf16 parameters, the fused loss)
            and (installed("compile") or not compiled)]  # a project may leave the compile part out
    if not rows:
        raise SystemExit(f"error: --mfu measures {sorted({c for c, _ in ROWS})}; --configs names none of them")
    if not args.no_tokenizer_row:
        config, compiled, _, length = next((row for row in rows if row[1]), rows[0])
        rows.append((config, compiled, None, length))
    return rows


def mfu_table(args: argparse.Namespace, scratch: Path, train_run: Callable) -> tuple[list[str], dict]:
    """train.py on each of `mfu_rows`, a table line each."""
    extra, compile_flag = tuple(shlex.split(args.train_flags)), [] if compiled_by_flags(args) else ["--torch_compile"]
    # an eager row stays eager however many --steps (unset, train.py compiles a run of 1,000 steps or more)
    eager_flag = ["--torch_compile", "false"] if installed("compile") and not compiled_by_flags(args) else []
    rows = mfu_rows(args)
    lines = [f"MFU: {args.model_config}, {args.num_processes} process(es), {args.mixed_precision}, micro-batch up to "
             f"{args.max_micro_batch} sequences, no accumulation, fused AdamW, {args.steps} steps; medians over the "
             f"logged intervals ({args.log_every} steps each) after the first"
             + (f"; train.py flags added: {args.train_flags}" if extra else ""), "",
             "| config | torch.compile | vocabulary | T | micro-batch | tokens/s | ms/step | MFU | MFU, whole run "
             "| peak memory (GiB) | final loss |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    results = []
    for config, compiled, vocabulary, length in rows:
        overrides = f"max_position_embeddings={length}" + (f",vocab_size={vocabulary}" if vocabulary else "")
        flags = ("--model_config", args.model_config, "--config_overrides", overrides, "--block_size", str(length),
                 "--max_steps", str(args.steps), "--logging_steps", str(args.log_every), "--eval_strategy", "no",
                 "--save_strategy", "no", *(compile_flag if compiled else eager_flag), *extra)
        name = f"{config}{'-compiled' if compiled else ''}-{vocabulary or 'tokenizer'}-{length}"
        run = fitting_run(train_run, config, args, scratch / name, flags)
        results.append({"config": config, "compiled": compiled, "vocabulary": vocabulary, "block_size": length} | run)
        shown = f"{vocabulary:,}" if vocabulary else f"{tokenizer_vocabulary():,} (tokenizer)"
        lines.append(f"| {config} | {'yes' if compiled else 'no'} | {shown} | {length} | "
                     f"{run['micro_batch']} | {run['tokens_per_sec']:,.0f} | {run['step_time'] * 1000:,.1f} | "
                     f"{run['mfu']:.1%} | {run['whole_run_mfu']:.1%} | {run['peak_memory_gb']:.2f} | "
                     f"{run['final_loss']:.3f} |")
        print(lines[-1], flush=True)
    return lines, {"mfu": results}
