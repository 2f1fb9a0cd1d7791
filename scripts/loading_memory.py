"""Host memory per rank while a pretrained model is built and `accelerator.prepare` shards it.

    python scripts/loading_memory.py                    # a ~220M-parameter Llama, fsdp and deepspeed_zero3, 2 processes
    python scripts/loading_memory.py --model_size 1b    # ~950M parameters: 3.6 GiB in fp32
    python scripts/loading_memory.py --model_dir /data/my-model --configs fsdp --num_processes 4

Into a `--model_dir` without weights (default: a temporary directory) it first saves a
randomly initialised Llama in bf16, as published checkpoints are, with the default
tokenizer; train.py loads it in fp32. Each config is launched with `accelerate launch`, and
every rank builds the model exactly as train.py does (`task.build_model` inside
`model_construction`, then `align_with_strategy` and `prepare` with the optimizer). Per rank:
- peak RSS (`ru_maxrss`) before the model (libraries and process group);
- what building the model added to it: the host memory a GPU run needs before the model
  moves to its GPU (a whole fp32 build is 4 bytes per parameter or more);
- what building and `prepare` added: on CPU this includes the shards and DeepSpeed's state,
  which on a GPU machine live in GPU memory;
- PSS once built, which counts the checkpoint's pages (read through mmap, shared by the ranks
  of a node) once per node instead of on every rank.
Not part of the test suite: about a minute per config for 220M on 2 CPU cores, 3 for 1B.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MARKER = "loading_memory:"


SIZES = {  # hidden size, layers, heads, MLP width
    "220m": (1024, 12, 16, 2816),
    "1b": (2048, 16, 16, 5632),
}


def save_model(model_dir: Path, size: str) -> int:
    """A randomly initialised Llama of `size` with the default tokenizer, as a pretrained directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from models.language import build_tokenizer

    tokenizer = build_tokenizer(None, None)
    hidden, layers, heads, mlp = SIZES[size]
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=mlp, max_position_embeddings=512, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # as checkpoints are published
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _pss() -> int:
    """Proportional set size now: pages shared between ranks (the checkpoint, read through mmap) count
    once per node, split among the ranks, where RSS counts them in full on every rank."""
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(next(line.split()[1] for line in rollup.splitlines() if line.startswith("Pss:"))) * 1024


def measure(train_flags: list[str]) -> None:
    """One rank: build and prepare the model as train.py does, then report this rank's peak RSS."""
    from accelerate.utils import gather_object

    from training.arguments import parse_args
    from training.optim import build_optimizer
    from training.strategy.accelerator import build_accelerator, model_construction
    from training.strategy.adapters import align_with_strategy, optimizer_offload_device
    from training.task_registry import build_task

    model_args, data_args, args = parse_args(train_flags)
    accelerator = build_accelerator(args)
    task = build_task(model_args, data_args)
    before = _peak_rss()  # libraries and process group: what every rank holds without a model
    with model_construction(accelerator, pretrained=True, can_build_empty=task.can_build_empty) as empty:
        model = task.build_model(None, empty)
    built, built_pss = _peak_rss(), _pss()
    align_with_strategy(accelerator, model, args.max_grad_norm, args.per_device_train_batch_size)
    optimizer = build_optimizer(model, args, offloaded=optimizer_offload_device(accelerator) != "none")
    model, optimizer = accelerator.prepare(model, optimizer)
    peaks = gather_object([(before, built, _peak_rss(), built_pss)])
    if accelerator.is_main_process:
        print(MARKER, json.dumps(peaks), flush=True)
    accelerator.end_training()


def launch(config: str, model_dir: Path, num_processes: int) -> list[list[int]]:
    """Every rank's peak RSS before the model, once built and after `prepare`, and its PSS once built."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}.yaml",
               "--num_processes", str(num_processes), __file__, "--measure", "--model_name_or_path", str(model_dir),
               "--output_dir", tempfile.mkdtemp(prefix="loading_memory_")]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    line = next((line for line in done.stdout.splitlines() if line.startswith(MARKER)), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"{config} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(line.removeprefix(MARKER))


def main() -> None:
    if "--measure" in sys.argv:  # a rank of a launch below
        measure([arg for arg in sys.argv[1:] if arg != "--measure"])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", type=Path,
                        help="a pretrained model directory (saved there first, a ~220M Llama, if it has no weights); "
                             "default: a temporary directory")
    parser.add_argument("--model_size", choices=SIZES, default="220m", help="the model saved when there is none")
    parser.add_argument("--configs", nargs="+", default=["fsdp", "deepspeed_zero3"])
    parser.add_argument("--num_processes", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loading_memory_model_") as scratch:
        model_dir = args.model_dir or Path(scratch)
        if not list(model_dir.glob("*.safetensors")):
            print(f"saved a model of {save_model(model_dir, args.model_size):,} parameters to {model_dir}", flush=True)
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        print(f"\nweights on disk: {size / 2**30:.2f} GiB\n")
        print("| config | processes | peak RSS per rank before the model (GiB) | building added (GiB) | "
              "building and `prepare` added (GiB) | PSS once built (GiB) |\n|---|---|---|---|---|---|")
        for config in args.configs:
            ranks = launch(config, model_dir, args.num_processes)
            columns = [[before for before, _, _, _ in ranks], [built - before for before, built, _, _ in ranks],
                       [after - before for before, _, after, _ in ranks], [pss for _, _, _, pss in ranks]]
            print(f"| {config} | {args.num_processes} | "
                  + " | ".join(", ".join(f"{value / 2**30:.2f}" for value in column) for column in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
