"""Throughput, memory and start-up of every strategy, side by side, and train.py against raw PyTorch.

    python scripts/benchmark.py                                  # llama-small, bf16, 2 processes, all configs
    python scripts/benchmark.py --model_config llama-tiny --steps 8 --configs ddp fsdp --rounds 1
    python scripts/benchmark.py --fine_tuning                    # full fine-tuning against LoRA, per strategy
    python scripts/benchmark.py --compression --plot docs/compression.png   # --ddp_comm_hook on the default job
    python scripts/benchmark.py --scaling --plot docs/scaling.png           # weak scaling on 1, 2, 4 processes
    python scripts/benchmark.py --pipeline --plot docs/pipeline.png         # pipeline schedules against a layer split
    python scripts/benchmark.py --distillation --plot docs/distillation.png # a student alone and distilled
    python scripts/benchmark.py --data --corpus_mb 200                      # data paths against training's appetite
    python scripts/benchmark.py --mfu                                       # MFU at a 50k vocabulary (part mfu)

Every config trains the same model on the same data for `--steps` optimizer steps with
`accelerate launch train.py`. The table shows, per strategy: tokens/s and step time
(medians after `--warmup` steps), time from launch to the first optimizer step, peak memory
per rank, and the model state each rank holds (parameters, gradients, optimizer state,
counted from its tensors just before the second optimizer step) next to what
scripts/plan_memory.py predicts for that config (parts/memory_plan). Then
train.py on DDP and `scripts/raw_ddp.py` run alternately, `--rounds` times each (each run's rate
is its tokens over its time after `--warmup`, loading included; the overhead figure is the median of
the per-round ratios: back-to-back runs share the machine's state), and the data preparation rate (tokenize + pack of the default corpus) is measured
in-process. The other tables are described by their functions (`fine_tuning_table`,
`compression_table`, `scaling_table`, `pipeline_table`,
`distillation_table`; the data table: scripts/data_benchmark.py; MFU: scripts/mfu_benchmark.py, the part mfu's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the template's modules: metrics, the planner, data preparation

from scripts.data_benchmark import data_table  # noqa: E402
from scripts.peer_benchmark import PEER_DEFAULTS, peers_table  # noqa: E402
from training.metrics import read_metrics  # noqa: E402
from training.parts import installed  # noqa: E402

CONFIGS = ["ddp", "fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload"]
SCALING_CONFIGS = ["ddp", "fsdp", "deepspeed_zero2"]
DEFAULTS = {"model_config": "llama-small", "per_device_train_batch_size": 8, "steps": 30, "warmup": 5, "log_every": 5}
PIPELINE_DEFAULTS = {"model_config": "llama-small", "per_device_train_batch_size": 64, "steps": 12, "warmup": 4, "log_every": 4, "mixed_precision": "no"}
DISTILLATION_DEFAULTS = {"model_config": "llama-tiny", "per_device_train_batch_size": 8, "steps": 300, "warmup": 5,
                         "log_every": 25}
RUN_TIMEOUT_S = 1800  # a run that takes longer is stuck: stop it rather than hang the benchmark


def planned_model_state_bytes(config: str, args: argparse.Namespace, processes: int) -> float:
    """What the memory planner predicts per rank for `config`: parameters + gradients + optimizer state (nan in a
    project without the memory_plan part)."""
    if not installed("memory_plan"):
        return math.nan
    from models.configs import build_named_config
    from models.language import build_tokenizer
    from parts.memory_plan.planner import model_shape, model_state, read_layout
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


def environment(output_dir: Path, one_thread: bool = True) -> dict[str, str]:
    """The runs' environment: one thread per process unless the caller set a count (`one_thread` false: each run
    keeps its own default, as --peers compares tools at their defaults)."""
    module_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # the caller's, after ours
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if one_thread else {}
    return os.environ | threads | {"PYTHONPATH": module_path, "TOKENIZERS_PARALLELISM": "false"}


def speed_flags(args: argparse.Namespace, task: tuple[str, ...] = ()) -> tuple[str, ...]:
    """train.py flags for a speed measurement: the benchmark's model, batch and steps, no evaluation or saving.
    `task`: flags that replace pretraining with `--block_size` (fine-tuning's)."""
    return ("--model_config", args.model_config, "--per_device_train_batch_size", str(args.per_device_train_batch_size),
            *(task or ("--block_size", str(args.block_size))), "--max_steps", str(args.steps),
            "--logging_steps", str(args.log_every), "--eval_strategy", "no", "--save_steps", str(10**9))


def start_launch(command: list[str], env: dict[str, str], log) -> subprocess.Popen:
    """`accelerate launch ...` (`command`) started in the repository with `env`, both streams to the file `log`.
    The one place a launch starts: tests/test_benchmarks.py runs most tables with the suite's forked launcher here."""
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def shown_mfu(run: dict) -> str:
    """A row's MFU as the table shows it (n/a: a project without the part mfu, or a device of unknown peak)."""
    return f"{run['mfu']:.1%}" if "mfu" in run else "n/a"


def train_run(config: str, args: argparse.Namespace, output_dir: Path, flags: tuple[str, ...] | None = None,
              processes: int | None = None) -> dict:
    """One train.py run (`flags`, default `speed_flags`) on `processes` (default --num_processes); its
    summary.json, per-step medians, and the time from launch to step 1. No report.png: the tables and
    figures come from each run's summary.json and metrics.jsonl."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}.yaml",
               "--num_processes", str(processes or args.num_processes), "--mixed_precision", args.mixed_precision,
               "--main_process_port", str(free_port()), "train.py", *(speed_flags(args) if flags is None else flags),
               *(["--report_png", "false"] if installed("report") else []), "--output_dir", str(output_dir)]
    metrics = output_dir / "metrics.jsonl"
    launched = time.perf_counter()
    with (output_dir.parent / f"{output_dir.name}.log").open("w") as log:
        process = start_launch(command, environment(output_dir, one_thread=not getattr(args, "peers", False)), log)
        first_step = None
        while process.poll() is None:
            if first_step is None and metrics.exists() and '"loss"' in metrics.read_text():
                first_step = time.perf_counter() - launched
            if time.perf_counter() - launched > RUN_TIMEOUT_S:
                process.kill()
            time.sleep(0.05)
    if process.returncode != 0:  # SystemExit: the message, then exit 1 (--mfu catches an out-of-memory)
        tail = Path(log.name).read_text()[-3000:]
        raise SystemExit(f"{tail}\nerror: train.py failed under {config} (exit {process.returncode}); its log ends above")
    steps = read_metrics(output_dir)
    steady = [m for m in steps if "tokens_per_sec" in m and m["step"] > args.warmup]
    return json.loads((output_dir / "summary.json").read_text()) | {
        "tokens_per_sec": statistics.median(m["tokens_per_sec"] for m in steady),
        "step_time": statistics.median(m["step_time"] for m in steady),
        **({"mfu": statistics.median(m["mfu"] for m in steady)} if "mfu" in steady[0] else {}),
        "time_to_first_step": first_step,
        "launch_to_exit": time.perf_counter() - launched,
        "intervals": steady,  # what the medians and the MFU are recomputed from
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

    saved_cache = datasets.config.HF_DATASETS_CACHE
    with tempfile.TemporaryDirectory() as cache:
        datasets.config.HF_DATASETS_CACHE = cache
        datasets.disable_progress_bars()
        try:
            raw, tokenizer = load_raw_datasets(None, None, None, None, 5, 42), build_tokenizer(None, None)
            start = time.perf_counter()
            train, validation = build_lm_datasets(raw, tokenizer, "text", block_size)
            return (len(train) + len(validation)) * block_size / (time.perf_counter() - start)
        finally:
            datasets.config.HF_DATASETS_CACHE = saved_cache
            datasets.enable_progress_bars()


def precision(args: argparse.Namespace) -> str:
    return "fp32" if args.mixed_precision == "no" else args.mixed_precision


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
        full = train_run(config, args, scratch / f"{config}-full", speed_flags(args, sft))
        lora = train_run(config, args, scratch / f"{config}-lora", speed_flags(args, (*sft, "--use_peft")))
        states = [run["model_state_bytes_per_rank"] for run in (full, lora)]
        full_state, lora_state = (f"{mib(sum(s.values()))}: {mib(s['parameters'])} + {mib(s['gradients'])} + "
                                  f"{mib(s['optimizer'])}" for s in states)
        results[config] = {"full": full, "lora": lora}
        lines.append(f"| {config} | {full['tokens_per_sec']:,.0f} | {lora['tokens_per_sec']:,.0f} | {full_state} | "
                     f"{lora_state} | {sum(states[1].values()) / sum(states[0].values()):.3f} |")
        print(lines[-1], flush=True)
    return lines, {"fine_tuning": results}


def distillation_table(args: argparse.Namespace, scratch: Path) -> tuple[list[str], dict]:
    """The student (--model_config) trained alone and distilled from a larger teacher for the same --steps on
    the embedded corpus, under the first of --configs: eval loss along the way and at the end. The teacher is
    --teacher, or the default job's model, trained first by train.py itself (`accelerate launch train.py`)."""
    teacher = args.teacher
    if teacher is None:
        train_run("single", args, scratch / "teacher", flags=(), processes=1)
        teacher = scratch / "teacher" / "final"
    config, extra = args.configs[0], tuple(shlex.split(args.train_flags))
    student = ("--model_config", args.model_config, "--per_device_train_batch_size", str(args.per_device_train_batch_size),
               "--max_steps", str(args.steps), "--logging_steps", str(args.log_every), "--eval_steps", str(args.log_every),
               "--save_strategy", "no")
    runs = {"alone": student, "distilled": (*student, "--teacher_model_name_or_path", str(teacher), *extra)}
    lines = [f"distillation: {args.model_config} on the embedded corpus, {config}, {args.num_processes} processes, "
             f"{precision(args)}, {args.per_device_train_batch_size} sequences per rank per step, {args.steps} steps; "
             f"teacher {teacher if args.teacher else 'the default job (' + str(teacher) + ')'}{', ' + args.train_flags if extra else ''}",
             "", "| student | final eval loss | best eval loss | tokens/s | teacher weights/rank (MiB) |", "|---|---:|---:|---:|---:|"]
    results, curves = {}, {}
    for name, flags in runs.items():
        run = results[name] = train_run(config, args, scratch / name, flags)
        curves[name] = [(m["step"], m["eval_loss"]) for m in read_metrics(scratch / name) if "eval_loss" in m]
        teacher_state = run.get("teacher_state_bytes_per_rank", {}).get("parameters")
        lines.append(f"| {name} | {run['eval_loss']:.4f} | {min(loss for _, loss in curves[name]):.4f} | "
                     f"{run['tokens_per_sec']:,.0f} | {mib(teacher_state) if teacher_state else ''} |")
        print(lines[-1], flush=True)
    if args.plot:
        plot_curves(args.plot, f"{args.model_config}: eval loss, alone and distilled", "optimizer step", "eval loss",
                    curves, log_y=True)
    return lines, {"distillation": results | {"teacher": str(teacher)}}


def pipeline_table(args: argparse.Namespace, scratch: Path) -> tuple[list[str], dict]:
    """The same model and global batch on 2 processes of one thread each as a naive layer split (GPipe over one
    micro-batch: one stage computes while the other waits), GPipe and 1F1B over --microbatches: throughput,
    the bubble (the share of the stages' time spent waiting, from when each stage computed each micro-batch)
    and the theoretical one, (p - 1) / (m + p - 1)."""
    stages = 2
    lines = [f"pipeline: {args.model_config} in {stages} stages on {stages} processes of 1 thread, {precision(args)}, "
             f"{args.per_device_train_batch_size} x {args.block_size} tokens per step, {args.steps} steps", "",
             "| schedule | micro-batches | tokens/s | vs naive split | bubble, measured | bubble, theory |",
             "|---|---:|---:|---:|---:|---:|"]
    results, timelines = {}, {}
    runs = [("naive split", "GPipe", 1)] + [(name, name, m) for name in args.schedules for m in args.microbatches]
    for label, schedule, micro in runs:
        output_dir = scratch / f"{schedule}-{micro}"
        flags = (*speed_flags(args), "--pipeline_parallel_size", str(stages), "--pipeline_schedule", schedule,
                 "--pipeline_microbatches", str(micro), "--pipeline_timeline")
        run = train_run("ddp", args, output_dir, flags, processes=stages)
        events = [e for e in json.loads((output_dir / "pipeline_timeline.json").read_text()) if e["step"] > args.warmup]
        measured, theory = bubble(events, stages), (stages - 1) / (micro + stages - 1)
        naive = results.get("naive split", run)["tokens_per_sec"]
        results[label if label == "naive split" else f"{schedule} m={micro}"] = run | {"bubble": measured, "theory": theory}
        timelines[f"{schedule} m={micro}"] = events
        lines.append(f"| {label} | {micro} | {run['tokens_per_sec']:,.0f} | {run['tokens_per_sec'] / naive:.2f}x | "
                     f"{measured:.0%} | {theory:.0%} |")
        print(lines[-1], flush=True)
    if args.plot:
        plot_timelines(args.plot, {f"{name} m={max(args.microbatches)}": timelines[f"{name} m={max(args.microbatches)}"]
                                   for name in args.schedules}, stages)
    return lines, {"pipeline": results}


def bubble(events: list[dict], stages: int) -> float:
    """1 - (time the stages computed) / (stages x wall time of the steps), over the recorded steps."""
    steps = {}
    for event in events:
        first, last, busy = steps.get(event["step"], (event["start"], event["end"], 0.0))
        steps[event["step"]] = (min(first, event["start"]), max(last, event["end"]), busy + event["end"] - event["start"])
    wall = sum(last - first for first, last, _ in steps.values())
    return 1 - sum(busy for *_, busy in steps.values()) / (stages * wall)


def plot_timelines(path: Path, timelines: dict[str, list[dict]], stages: int) -> None:
    """One recorded step per schedule: a row per stage, a bar per micro-batch's forward (F) and backward (B)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 1.6 * stages * len(timelines)))
    for axes, (name, events) in zip(figure.subplots(len(timelines), 1, squeeze=False)[:, 0], timelines.items()):
        step = [e for e in events if e["step"] == max(e["step"] for e in events)]
        origin = min(e["start"] for e in step)
        for e in step:
            axes.barh(e["stage"], (e["end"] - e["start"]) * 1000, left=(e["start"] - origin) * 1000, height=0.6,
                      color="tab:blue" if e["kind"] == "forward" else "tab:orange", edgecolor="white")
            axes.text((e["start"] - origin + (e["end"] - e["start"]) / 2) * 1000, e["stage"],
                      f"{e['kind'][0].upper()}{e['micro_batch']}", ha="center", va="center", color="white", fontsize=8)
        axes.set(title=f"{name}: one step, measured (F forward, B backward of micro-batch n)", xlabel="ms",
                 yticks=range(stages), yticklabels=[f"stage {s}" for s in range(stages)])
        axes.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def compression_table(args: argparse.Namespace, scratch: Path) -> tuple[list[str], dict]:
    """The default job (plus --train_flags) under the ddp config with each --ddp_comm_hook: the bytes each rank
    all-reduces per optimizer step (counted by the hook's wrapper), tokens/s and the losses; `allreduce` is
    DDP's uncompressed all-reduce through the same counter."""
    extra = tuple(shlex.split(args.train_flags))
    lines = [f"gradient compression: the default job{' with ' + args.train_flags if extra else ''}, ddp, "
             f"{args.num_processes} processes, {precision(args)}; PowerSGD rank {args.power_sgd_rank} from step "
             f"{args.power_sgd_start_step}", "",
             "| --ddp_comm_hook | all-reduced per step per rank (KiB) | vs allreduce | tokens/s | final train loss "
             "| final eval loss |", "|---|---:|---:|---:|---:|---:|"]
    results, curves = {}, {}
    for hook in args.hooks:
        power_sgd = ("--power_sgd_rank", str(args.power_sgd_rank), "--power_sgd_start_step", str(args.power_sgd_start_step))
        flags = ("--ddp_comm_hook", hook, *(power_sgd if "power_sgd" in hook else ()), *extra)
        run = results[hook] = train_run("ddp", args, scratch / hook, flags)
        curves[hook] = [(m["step"], m["loss"]) for m in read_metrics(scratch / hook) if "loss" in m]
        sent, baseline = run["gradient_allreduce_bytes_per_step"], results.get("allreduce", {}).get("gradient_allreduce_bytes_per_step")
        lines.append(f"| {hook} | {sent / 1024:,.1f} | {f'{sent / baseline:.3f}' if baseline else ''} | "
                     f"{run['tokens_per_sec']:,.0f} | {run['train_loss']:.4f} | {run.get('eval_loss', float('nan')):.4f} |")
        print(lines[-1], flush=True)
    if args.plot:
        plot_curves(args.plot, "train loss by --ddp_comm_hook (ddp, default job)", "optimizer step", "train loss",
                    curves, log_y=True)
    return lines, {"compression": results}


def scaling_table(args: argparse.Namespace, scratch: Path) -> tuple[list[str], dict]:
    """Weak scaling: the same per-process batch on 1, 2, 4... processes of one thread each, per config;
    speed-up is throughput over one process's, efficiency is speed-up over processes."""
    counts = " / ".join(map(str, args.processes))
    lines = [f"weak scaling: {args.model_config}, {precision(args)}, {args.per_device_train_batch_size} x "
             f"{args.block_size} tokens per process per step, {args.steps} steps, 1 thread per process "
             f"(OMP_NUM_THREADS=1), on a machine with {os.cpu_count()} cores", "",
             f"| strategy | tokens/s on {counts} processes | speed-up | efficiency |", "|---|---|---|---|"]
    results = {}
    for config in args.configs:
        for processes in args.processes:
            run = train_run(config, args, scratch / f"{config}-{processes}", processes=processes)
            speedup = run["tokens_per_sec"] / results.get(config, {}).get(args.processes[0], run)["tokens_per_sec"]
            results.setdefault(config, {})[processes] = run | {"speedup": speedup, "efficiency": speedup / processes}
        lines.append(scaling_row(config, results[config]))
        print(lines[-1], flush=True)
    if args.plot:
        curves = {label: {config: [(n, run[key]) for n, run in runs.items()] for config, runs in results.items()}
                  for key, label in (("tokens_per_sec", "tokens/s (all processes)"),
                                     ("efficiency", "efficiency (speed-up / processes)"))}
        plot_panels(args.plot, f"weak scaling on {os.cpu_count()} cores", "processes", list(curves.items()))
    return lines, {"scaling": results}


def scaling_row(config: str, runs: dict[int, dict]) -> str:
    """One config's row: throughput, speed-up and efficiency at each process count."""
    columns = [[f"{run['tokens_per_sec']:,.0f}" for run in runs.values()], [f"{run['speedup']:.2f}" for run in runs.values()],
               [f"{run['efficiency']:.0%}" for run in runs.values()]]
    return f"| {config} | " + " | ".join(" / ".join(column) for column in columns) + " |"


def plot_curves(path: Path, title: str, xlabel: str, ylabel: str, curves: dict, log_y: bool = False) -> None:
    plot_panels(path, title, xlabel, [(ylabel, curves)], log_y)


def plot_panels(path: Path, title: str, xlabel: str, panels: list[tuple[str, dict]], log_y: bool = False) -> None:
    """One panel per (ylabel, {label: [(x, y)]}), side by side, written to `path`."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6 * len(panels), 4.5))
    figure.suptitle(title)
    for axes, (ylabel, curves) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels):
        for label, points in curves.items():
            axes.plot(*zip(*points), "o-" if len(points) < 10 else "-", label=label, markersize=4)
        axes.set(xlabel=xlabel, ylabel=ylabel)
        axes.grid(alpha=0.3)
        axes.legend()
        if log_y:
            axes.set_yscale("log")
    figure.savefig(path, dpi=100, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_config", help="Default: llama-small; --distillation: llama-tiny (the student).")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, help="Default: every config; --scaling: " + " ".join(SCALING_CONFIGS))
    parser.add_argument("--num_processes", type=int, help="Default 2; --mfu: one per GPU (1 on CPU).")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], help="Default: bf16; --compression: no (the default job's).")
    parser.add_argument("--per_device_train_batch_size", type=int, help="Default 8; --pipeline: 64.")
    parser.add_argument("--block_size", type=int, help="Default 256; --peers: 128.")
    parser.add_argument("--steps", type=int, help="Default 30; --pipeline: 12.")
    parser.add_argument("--warmup", type=int, help="Steps left out of the medians. Default 5; --pipeline: 4.")
    parser.add_argument("--log_every", type=int, help="train.py's --logging_steps: a median per interval. Default 5; --pipeline: 4.")
    parser.add_argument("--rounds", type=int, default=3, help="train.py/raw DDP pairs for the overhead figure.")
    parser.add_argument("--fine_tuning", action="store_true",
                        help="Instead: full fine-tuning against LoRA per strategy (--block_size is then --max_length).")
    parser.add_argument("--compression", action="store_true",
                        help="Instead: the default job under ddp with each --hooks (bytes all-reduced, tokens/s, losses).")
    parser.add_argument("--hooks", nargs="+", default=["allreduce", "fp16", "power_sgd", "batched_power_sgd"],
                        help="--compression: the --ddp_comm_hook values, allreduce (the uncompressed baseline) first.")
    parser.add_argument("--power_sgd_rank", type=int, default=1)
    parser.add_argument("--power_sgd_start_step", type=int, default=20, help="About 10%% of the default job on 2 processes.")
    parser.add_argument("--train_flags", default="", help="--compression, --mfu: train.py flags added to every run's.")
    parser.add_argument("--scaling", action="store_true",
                        help="Instead: weak scaling of --configs (default ddp fsdp deepspeed_zero2) on --processes.")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="--scaling: process counts, 1 first.")
    parser.add_argument("--pipeline", action="store_true",
                        help="Instead: naive layer split, GPipe and 1F1B on 2 processes (throughput, bubble).")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8], help="--pipeline: micro-batch counts.")
    parser.add_argument("--schedules", nargs="+", default=["GPipe", "1F1B"], choices=["GPipe", "1F1B"],
                        help="--pipeline: the schedules set against the naive split.")
    parser.add_argument("--distillation", action="store_true",
                        help="Instead: --model_config (default llama-tiny) trained alone and distilled from --teacher "
                             "(default: the default job's model, trained first) for --steps; eval loss curves.")
    parser.add_argument("--teacher", type=Path, help="--distillation: a trained teacher (Hub format).")
    parser.add_argument("--data", action="store_true",
                        help="Tokens/s each data path delivers per rank (in memory, streaming, pre-tokenised) against "
                             "what the default job consumes; scripts/prepare_data.py with 1 and 2 processes.")
    parser.add_argument("--corpus_mb", type=float, default=200, help="--data: the generated corpus's size.")
    parser.add_argument("--data_batches", type=int, default=200, help="--data: micro-batches read per data path.")
    parser.add_argument("--peers", action="store_true",
                        help="Instead: train.py against transformers' Trainer on the same model, data, batch, schedule "
                             "and steps (default llama-tiny, 8 x 128 tokens, 150 steps, fp32), on 1 and 2 processes, "
                             "alternating --rounds (scripts/peer_benchmark.py).")
    parser.add_argument("--nanogpt", type=Path, help="--peers: a checkout of karpathy/nanoGPT; also its CPU recipe "
                        "(Shakespeare by character) against train.py at that shape, on one process.")
    parser.add_argument("--nanogpt_steps", type=int, default=2000, help="--nanogpt: iterations (its recipe's 2,000).")
    parser.add_argument("--mfu", action="store_true",
                        help="Instead: MFU of ddp (eager and compiled), fsdp and deepspeed_zero2 on llama-125m with a "
                             "50k vocabulary, at the largest micro-batch that fits (scripts/mfu_benchmark.py).")
    parser.add_argument("--block_sizes", type=int, nargs="+", help="--mfu: sequence lengths T. Default 1024 2048 (CPU: 64 128).")
    parser.add_argument("--no_tokenizer_row", action="store_true", help="--mfu: leave out the row at the shipped tokenizer's vocabulary.")
    parser.add_argument("--eager_only", action="store_true",
                        help="--mfu: leave out the compiled rows (for --train_flags that --torch_compile refuses).")
    parser.add_argument("--max_micro_batch", type=int, help="--mfu: the first micro-batch tried. Default 64 (CPU: 4).")
    parser.add_argument("--plot", type=Path, help="--compression/--scaling/--pipeline/--distillation: also draw the figure to this PNG.")
    parser.add_argument("--output", type=Path, help="Also write the tables to this markdown file.")
    parser.add_argument("--json", type=Path, help="Also write every figure to this JSON file.")
    args = parser.parse_args(argv)
    args.configs = args.configs or (SCALING_CONFIGS if args.scaling else CONFIGS)
    if args.mfu:  # one process per GPU; on a machine without one, a tiny shape on one process
        if not installed("mfu"):
            raise SystemExit("error: --mfu needs the part mfu, which this project left out (scripts/new_project.py)")
        import torch

        from scripts.mfu_benchmark import CPU_DEFAULTS, GPU_DEFAULTS, mfu_table

        defaults = GPU_DEFAULTS if torch.cuda.is_available() else CPU_DEFAULTS
        args.num_processes = args.num_processes or torch.cuda.device_count() or 1
    # The pipeline table: fp32 and 64 sequences per step, so that 8 micro-batches still keep a core busy
    # (bf16 with 8 per step measured 1.27x for 1F1B over the naive split; this 1.77x).
    if not args.mfu:
        defaults = (PIPELINE_DEFAULTS if args.pipeline else DISTILLATION_DEFAULTS if args.distillation else
                    PEER_DEFAULTS if args.peers else DEFAULTS)
        args.num_processes = args.num_processes or 2
    for key, value in ({"block_size": 256} | defaults).items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    args.mixed_precision = args.mixed_precision or ("no" if args.compression or args.distillation or args.data else "bf16")
    table = {"fine_tuning": fine_tuning_table, "compression": compression_table, "scaling": scaling_table,
             "pipeline": pipeline_table, "distillation": distillation_table,
             "data": lambda args, scratch: data_table(args, scratch, train_run),
             "mfu": lambda args, scratch: mfu_table(args, scratch, train_run),  # (imported with --mfu only)
             "peers": lambda args, scratch: peers_table(args, scratch, train_run, environment(REPO, one_thread=False),
                                                       free_port)}
    if chosen := [name for name in table if getattr(args, name)]:
        with tempfile.TemporaryDirectory() as scratch:
            lines, results = table[chosen[0]](args, Path(scratch))
        write_outputs(lines, {"settings": vars(args) | {"output": None, "json": None, "plot": None}, **results}, args)
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
                f"{shown_mfu(run)} | {run['time_to_first_step']:.1f} | "
                f"{run['peak_memory_gb'] * 1024:,.0f} | {mib(measured)}: "
                f"{mib(state['parameters'])} + {mib(state['gradients'])} + {mib(state['optimizer'])} | "
                f"{mib(planned)} | {measured / planned:.3f} |"
            )
            print(lines[-1], flush=True)
        ours, raw, ours_intervals = [], [], []
        for round_ in range(args.rounds):
            # the statistic raw_ddp.py reports: tokens / time over the steps after warm-up (equal tokens per interval)
            ours_intervals.append(train_run("ddp", args, Path(scratch) / f"overhead{round_}")["intervals"])
            ours.append(len(ours_intervals[-1]) / sum(1 / m["tokens_per_sec"] for m in ours_intervals[-1]))
            raw.append(raw_run(args))
            print(f"round {round_ + 1}: train.py {ours[-1]:,.0f} tokens/s, raw DDP {raw[-1]:,.0f}", flush=True)
    ratio = statistics.median(a / b for a, b in zip(ours, raw))  # rounds run back to back: compare within each
    data_rate = data_preparation_rate(args.block_size)
    results |= {"train_py_tokens_per_sec": ours, "train_py_intervals": ours_intervals, "raw_ddp_tokens_per_sec": raw,
                "train_py_over_raw": ratio,
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
