"""Throughput, memory and start-up of every strategy, side by side, and train.py against raw PyTorch.

    python scripts/benchmark.py                                  # llama-small, bf16, 2 processes, all configs
    python scripts/benchmark.py --model_config llama-tiny --steps 8 --configs ddp fsdp --rounds 1
    python scripts/benchmark.py --fine_tuning                    # full fine-tuning against LoRA, per strategy

Every config trains the same model on the same data for `--steps` optimizer steps with
`accelerate launch train.py`. The table shows, per strategy: tokens/s and step time
(medians after `--warmup` steps), time from launch to the first optimizer step, peak memory
per rank, and the model state each rank holds (parameters, gradients, optimizer state,
counted from its tensors just before the second optimizer step) next to what
scripts/plan_memory.py predicts for that config (training/memory_plan.py). Then
train.py on DDP and `scripts/raw_ddp.py` run alternately, `--rounds` times each (the
overhead figure is the median of the per-round ratios: back-to-back runs share the machine's
state), and the data preparation rate (tokenize + pack of the default corpus) is measured
in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the template's modules: metrics, the planner, data preparation

from training.metrics import read_metrics  # noqa: E402

CONFIGS = ["ddp", "fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload"]
RUN_TIMEOUT_S = 1800  # a run that takes longer is stuck: stop it rather than hang the benchmark


def planned_model_state_bytes(config: str, args: argparse.Namespace, processes: int) -> float:
    """What the memory planner predicts per rank for `config`: parameters + gradients + optimizer state."""
    from models.configs import build_named_config
    from models.language import build_tokenizer
    from training.memory_plan import model_shape, model_state, read_layout
    from training.performance import compute_dtype

    dtype = compute_dtype(args.mixed_precision)
    shape = model_shape(build_named_config(args.model_config, build_tokenizer(None, None)), dtype)
    layout = read_layout(REPO / "accelerate_configs" / f"{config}.yaml")
    planned = model_state(layout, shape.parameters, processes, dtype.itemsize)
    return planned["parameters"] + planned["gradients"] + planned["optimizer"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(output_dir: Path) -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO),
                         "TOKENIZERS_PARALLELISM": "false"}


def train_run(config: str, args: argparse.Namespace, output_dir: Path, task: tuple[str, ...] = ()) -> dict:
    """One train.py run; its summary.json, per-step medians, and the time from launch to step 1.
    `task`: train.py flags that replace pretraining with `--block_size` (fine-tuning's)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}.yaml",
               "--num_processes", str(args.num_processes), "--mixed_precision", args.mixed_precision,
               "--main_process_port", str(free_port()), "train.py",
               "--model_config", args.model_config, "--per_device_train_batch_size", str(args.per_device_train_batch_size),
               *(task or ("--block_size", str(args.block_size))), "--max_steps", str(args.steps),
               "--logging_steps", str(args.log_every),
               "--eval_strategy", "no", "--save_steps", str(10**9),  # training speed only
               "--output_dir", str(output_dir)]
    metrics = output_dir / "metrics.jsonl"
    launched = time.perf_counter()
    with (output_dir.parent / f"{output_dir.name}.log").open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=environment(output_dir), stdout=log, stderr=subprocess.STDOUT)
        first_step = None
        while process.poll() is None:
            if first_step is None and metrics.exists() and '"loss"' in metrics.read_text():
                first_step = time.perf_counter() - launched
            if time.perf_counter() - launched > RUN_TIMEOUT_S:
                process.kill()
            time.sleep(0.05)
    if process.returncode != 0:
        tail = Path(log.name).read_text()[-3000:]
        sys.exit(f"{tail}\nerror: train.py failed under {config} (exit {process.returncode}); its log ends above")
    steps = read_metrics(output_dir)
    steady = [m for m in steps if "tokens_per_sec" in m and m["step"] > args.warmup]
    return json.loads((output_dir / "summary.json").read_text()) | {
        "tokens_per_sec": statistics.median(m["tokens_per_sec"] for m in steady),
        "step_time": statistics.median(m["step_time"] for m in steady),
        "time_to_first_step": first_step,
    }


def raw_run(args: argparse.Namespace) -> float:
    """Median tokens/s of scripts/raw_ddp.py on the same settings."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.num_processes),
               "--master_port", str(free_port()), "scripts/raw_ddp.py", "--model_config", args.model_config, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--per_device_train_batch_size", str(args.per_device_train_batch_size),
               "--block_size", str(args.block_size), *(["--bf16"] if args.mixed_precision == "bf16" else [])]
    result = subprocess.run(command, cwd=REPO, env=environment(REPO), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    if result.returncode != 0:
        sys.exit(f"error: raw_ddp.py failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["tokens_per_sec"]


def data_preparation_rate(block_size: int) -> float:
    """Tokens per second of tokenize + pack of the default corpus, into an empty cache."""
    import datasets

    from data import build_lm_datasets, load_raw_datasets
    from models.language import build_tokenizer

    with tempfile.TemporaryDirectory() as cache:
        datasets.config.HF_DATASETS_CACHE = cache
        datasets.disable_progress_bars()
        raw, tokenizer = load_raw_datasets(None, None, None, None, 5, 42), build_tokenizer(None, None)
        start = time.perf_counter()
        train, validation = build_lm_datasets(raw, tokenizer, "text", block_size)
        return (len(train) + len(validation)) * block_size / (time.perf_counter() - start)


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def save_base_model(model_config: str, directory: Path) -> Path:
    """A model in Hub format to fine-tune: `model_config` initialised (its speed does not depend on its weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.configs import build_named_config
    from models.language import build_tokenizer

    tokenizer = build_tokenizer(None, None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_named_config(model_config, tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def fine_tuning_table(args: argparse.Namespace, scratch: Path) -> tuple[list[str], dict]:
    """Full fine-tuning against a LoRA adapter (`--use_peft`, defaults) of the same model on the embedded chat
    set, per strategy: tokens/s and the model state each rank holds."""
    base = save_base_model(args.model_config, scratch / "base")
    sft = ("--task", "sft", "--model_name_or_path", str(base), "--max_length", str(args.block_size))
    lines = [f"fine-tuning {args.model_config} on the embedded chat set (--task sft), {args.num_processes} processes, "
             f"{args.mixed_precision}, {args.per_device_train_batch_size} conversations per rank per step, {args.steps} steps",
             "", "| strategy | full: tokens/s | LoRA: tokens/s | full: model state/rank (MiB): params + grads + optimizer "
             "| LoRA: model state/rank (MiB) | LoRA / full state |", "|---|---:|---:|---|---|---:|"]
    results = {}
    for config in args.configs:
        full = train_run(config, args, scratch / f"{config}-full", sft)
        lora = train_run(config, args, scratch / f"{config}-lora", (*sft, "--use_peft"))
        states = [run["model_state_bytes_per_rank"] for run in (full, lora)]
        full_state, lora_state = (f"{mib(sum(s.values()))}: {mib(s['parameters'])} + {mib(s['gradients'])} + "
                                  f"{mib(s['optimizer'])}" for s in states)
        results[config] = {"full": full, "lora": lora}
        lines.append(f"| {config} | {full['tokens_per_sec']:,.0f} | {lora['tokens_per_sec']:,.0f} | {full_state} | "
                     f"{lora_state} | {sum(states[1].values()) / sum(states[0].values()):.3f} |")
        print(lines[-1], flush=True)
    return lines, {"fine_tuning": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_config", default="llama-small")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--mixed_precision", default="bf16", choices=["no", "bf16"])
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="Steps left out of the medians.")
    parser.add_argument("--log_every", type=int, default=5, help="train.py's --logging_steps: a median per interval.")
    parser.add_argument("--rounds", type=int, default=3, help="train.py/raw DDP pairs for the overhead figure.")
    parser.add_argument("--fine_tuning", action="store_true",
                        help="Instead: full fine-tuning against LoRA per strategy (--block_size is then --max_length).")
    parser.add_argument("--output", type=Path, help="Also write the tables to this markdown file.")
    parser.add_argument("--json", type=Path, help="Also write every figure to this JSON file.")
    args = parser.parse_args()
    if args.fine_tuning:
        with tempfile.TemporaryDirectory() as scratch:
            lines, results = fine_tuning_table(args, Path(scratch))
        write_outputs(lines, {"settings": vars(args) | {"output": None, "json": None}, **results}, args)
        return

    lines = [f"model {args.model_config}, {args.num_processes} processes, {args.mixed_precision}, "
             f"{args.per_device_train_batch_size} x {args.block_size} tokens per rank per step, {args.steps} steps",
             "", "| strategy | processes | tokens/s | step time (ms) | MFU | launch to first step (s) "
             "| peak memory/rank (MiB) | model state/rank (MiB): params + grads + optimizer | planner (MiB) "
             "| measured / planner |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    results = {"settings": vars(args) | {"output": None, "json": None}, "strategies": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for config in args.configs:
            run = train_run(config, args, Path(scratch) / config)
            state = run["model_state_bytes_per_rank"]
            measured = sum(state.values())
            planned = planned_model_state_bytes(config, args, run["processes"])
            results["strategies"][config] = run | {"model_state_bytes": measured, "planned_bytes": planned}
            lines.append(
                f"| {config} | {run['processes']} | {run['tokens_per_sec']:,.0f} | {run['step_time'] * 1000:,.0f} | "
                f"{run.get('mfu', float('nan')):.1%} | {run['time_to_first_step']:.1f} | "
                f"{run['peak_memory_gb'] * 1024:,.0f} | {mib(measured)}: "
                f"{mib(state['parameters'])} + {mib(state['gradients'])} + {mib(state['optimizer'])} | "
                f"{mib(planned)} | {measured / planned:.3f} |"
            )
            print(lines[-1], flush=True)
        ours, raw = [], []
        for round_ in range(args.rounds):
            ours.append(train_run("ddp", args, Path(scratch) / f"overhead{round_}")["tokens_per_sec"])
            raw.append(raw_run(args))
            print(f"round {round_ + 1}: train.py {ours[-1]:,.0f} tokens/s, raw DDP {raw[-1]:,.0f}", flush=True)
    ratio = statistics.median(a / b for a, b in zip(ours, raw))  # rounds run back to back: compare within each
    data_rate = data_preparation_rate(args.block_size)
    results |= {"train_py_tokens_per_sec": ours, "raw_ddp_tokens_per_sec": raw, "train_py_over_raw": ratio,
                "data_preparation_tokens_per_sec": data_rate}
    lines += ["", "| round | train.py on DDP (tokens/s) | raw PyTorch DDP, scripts/raw_ddp.py (tokens/s) | ratio |",
              "|---:|---:|---:|---:|",
              *(f"| {i + 1} | {a:,.0f} | {b:,.0f} | {a / b:.3f} |" for i, (a, b) in enumerate(zip(ours, raw))),
              f"| median | | | **{ratio:.3f}** |", "",
              f"data preparation (tokenize + pack, default corpus): {data_rate:,.0f} tokens/s"]
    write_outputs(lines, results, args)


def write_outputs(lines: list[str], results: dict, args: argparse.Namespace) -> None:
    print("\n".join(lines))
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
