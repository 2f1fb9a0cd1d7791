"""The optimizer step ZeRO offload runs on the CPU: torch's AdamW against DeepSpeed's CPU Adam, side by side.

    OMP_NUM_THREADS=1 python scripts/cpu_optimizer_step.py    # as torchrun starts each rank
    OMP_NUM_THREADS=16 python scripts/cpu_optimizer_step.py

Under ZeRO optimizer offload the AdamW update runs on the CPU, over the fp32 master
partitions. training/optim.py then builds DeepSpeed's `DeepSpeedCPUAdam` (compiled on first
use, about a minute, then cached); this prints the seconds per step of each candidate on
the same parameters (llama-125m's matrices) and gradients, so that choice can be re-checked
on another CPU. Both torch and DeepSpeed's OpenMP kernel take their threads from
OMP_NUM_THREADS.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.flags import TrainArguments  # noqa: E402
from training.optim import prepare_cpu_adam  # noqa: E402

# llama-125m with the shipped tokenizer: 12 layers of 4 attention and 3 MLP matrices, embeddings and output.
LLAMA_125M = [768 * 768] * 48 + [768 * 2048] * 36 + [917 * 768] * 2


def seconds_per_step(make_optimizer, steps: int) -> float:
    optimizer = make_optimizer()
    optimizer.step()  # first step: state allocation
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    prepare_cpu_adam(TrainArguments())  # as train.py loads it: the same build
    params = [torch.nn.Parameter(torch.randn(n)) for n in LLAMA_125M]
    for param in params:
        param.grad = torch.randn_like(param)
    settings = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    candidates = {
        "torch AdamW (foreach)": lambda: torch.optim.AdamW(params, foreach=True, **settings),
        "torch AdamW (fused)": lambda: torch.optim.AdamW(params, fused=True, **settings),
        "DeepSpeedCPUAdam": lambda: DeepSpeedCPUAdam(params, adamw_mode=True, **settings),
    }
    threads = os.environ.get("OMP_NUM_THREADS", f"unset, torch uses {torch.get_num_threads()}")
    print(f"| optimizer ({sum(LLAMA_125M) / 1e6:.0f}M fp32 parameters, OMP_NUM_THREADS {threads}) | s/step |")
    print("|---|---:|")
    for name, make in candidates.items():
        print(f"| {name} | {seconds_per_step(make, args.steps):.3f} |")


if __name__ == "__main__":
    main()
