"""Checkpoint save and resume time per strategy: accelerate's native `save_state`/`load_state` against the template's
whole checkpoint (`save_checkpoint`: model_state/, accelerate's save of the rest, every file's SHA-256 and the
manifest; `load_checkpoint`: every file checked against the manifest, then loaded), side by side in each launch.

    python scripts/save_benchmark.py                                   # llama-125m, every data-parallel config
    python scripts/save_benchmark.py --model_config llama-tiny --configs ddp --rounds 1

Each config trains one step of the model (2 processes; the launch's own state: weights, AdamW moments, schedule,
RNG), then saves and loads it `--rounds` times in each format, alternating, to the same disk, after a round that
warms up (imports, first writes); the table shows the medians, the template's over the native time, and the bytes
written. The figures in docs/reliability.md come from the first command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIGS = ["ddp", "fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload"]


def directory_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def worker(argv: list[str]) -> None:
    """In each rank of a launch: one training step, then each format's save and load timed in turn (every rank waits
    for all)."""
    from training.arguments import parse_args
    from training.checkpoints.resume import epoch_batches, load_checkpoint
    from training.checkpoints.save import save_checkpoint
    from training.setup import set_up
    from training.step import NonFiniteGuard, accumulation_windows, optimizer_step

    results, rounds = Path(argv[0]), int(argv[1])
    run = set_up(*parse_args(argv[2:]))
    accelerator, state = run.accelerator, run.state
    window = next(accumulation_windows(epoch_batches(accelerator, run.train_loader, state, 0),
                                       run.args.gradient_accumulation_steps))
    optimizer_step(run, window, NonFiniteGuard(accelerator.device))

    def native_save(directory: Path) -> Path:
        accelerator.save_state(str(directory))
        return directory

    def template_save(directory: Path) -> Path:
        return save_checkpoint(accelerator, run.runner, run.model, run.optimizer, str(directory), state, None)

    def native_load(path: Path) -> None:
        accelerator.load_state(str(path))

    def template_load(path: Path) -> None:
        load_checkpoint(accelerator, path, state, run.max_steps, run.runner, run.model, run.optimizer, run.scheduler)

    formats = {"native": (native_save, native_load), "template": (template_save, template_load)}
    seconds, sizes = {f"{name} {what}": [] for name in formats for what in ("save", "load")}, {}

    def timed(key: str, counted: bool, act):
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        result = act()
        accelerator.wait_for_everyone()
        seconds[key] += [time.perf_counter() - start] if counted else []
        return result

    for index in range(rounds + 1):  # the first round warms up (imports, first writes) and is not counted
        for name, (save, load) in formats.items():
            directory = Path(run.args.output_dir) / f"{name}-{index}"
            saved = timed(f"{name} save", index > 0, lambda: save(directory))
            timed(f"{name} load", index > 0, lambda: load(saved))
            sizes[name] = directory_bytes(directory)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                shutil.rmtree(directory)
    if accelerator.is_main_process:
        results.write_text(json.dumps({"seconds": seconds, "bytes": sizes}))
    accelerator.end_training()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_config", default="llama-125m")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--rounds", type=int, default=3, help="saves per format per config (medians)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    rows, figures = [], {}
    print("| config | native save_state (s) | template save (s) | ratio | native load_state (s) | template resume (s) | "
          "ratio | native MB | template MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config in args.configs:
        with tempfile.TemporaryDirectory() as scratch:
            results = Path(scratch) / "results.json"
            command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       str(REPO / "accelerate_configs" / f"{config}.yaml"), str(Path(__file__).resolve()), "--worker",
                       str(results), str(args.rounds), "--model_config", args.model_config, "--output_dir",
                       str(Path(scratch) / "run"), "--report_to", "none", "--report_png", "false", "--eval_on_start",
                       "false", "--max_steps", "2", "--per_device_train_batch_size", "4"]
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                                  env=os.environ | {"OMP_NUM_THREADS": "1"})
            if done.returncode != 0:
                raise SystemExit(f"{config} failed:\n{done.stderr[-4000:]}")
            measured = json.loads(results.read_text())
        median = {key: statistics.median(values) for key, values in measured["seconds"].items()}
        row = figures[config] = median | {"save ratio": median["template save"] / median["native save"],
                                          "load ratio": median["template load"] / median["native load"],
                                          "native bytes": measured["bytes"]["native"],
                                          "template bytes": measured["bytes"]["template"]}
        rows.append(f"| {config} | {row['native save']:.2f} | {row['template save']:.2f} | {row['save ratio']:.2f} | "
                    f"{row['native load']:.2f} | {row['template load']:.2f} | {row['load ratio']:.2f} | "
                    f"{row['native bytes'] / 2**20:,.0f} | {row['template bytes'] / 2**20:,.0f} |")
        print(rows[-1], flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        main()
