"""The data table of scripts/benchmark.py (`--data`): what each data path delivers against what training consumes.

    python scripts/benchmark.py --data --corpus_mb 200     # the figures in docs/streaming.md

- **Delivered per rank**: sequences of the default job's shape (`--block_size`, `--per_device_train_batch_size`)
  read through train.py's own loaders with the model replaced by nothing, in this process (one core, as each
  rank has): in memory (the tokenised set, `DataLoader` as train.py builds it), streaming (`--streaming`:
  jsonl shards tokenised and packed on the fly, `StreamLoader`), pre-tokenised (`--dataset_path`: the Arrow
  shards scripts/prepare_data.py wrote). Each reads `--data_batches` micro-batches after one warm-up batch.
- **Consumed per rank**: the default job's tokens/s per rank, measured by a short train.py run on 1 process.
- **Prepare**: scripts/prepare_data.py's tokens/s with `--num_proc` 1 and 2, on a corpus of `--corpus_mb` MB
  generated from the embedded corpus's grammar (its figure includes packing, not writing the shards).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
SHARDS = 4  # jsonl files the corpus is written as: the stream's shards
ONE_CORE = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # a process per core: no tokenizer threads


def write_corpus(directory: Path, megabytes: float) -> int:
    """Documents of the embedded corpus's grammar, SHARDS training files and a validation file, to `megabytes` in
    all; returns the bytes written."""
    from data.default_corpus import generate_documents

    directory.mkdir(parents=True)
    files = [(directory / f"train-{index:05d}.jsonl").open("w") for index in range(SHARDS)]
    written, seed = 0, 0
    while written < megabytes * 2**20:
        for index, document in enumerate(generate_documents(2000, seed)):
            line = json.dumps({"text": document}) + "\n"
            files[index % SHARDS].write(line)
            written += len(line)
        seed += 1
    for file in files:
        file.close()
    (directory / "validation-00000.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in generate_documents(400, 10**6)))
    return written


def tokens_per_sec(batches: Iterable[dict], count: int) -> float:
    """Tokens per second of `count` micro-batches, after a first one (start-up: workers, a shuffle buffer's fill)."""
    iterator = iter(batches)
    next(iterator)
    start, tokens = time.perf_counter(), 0
    for _ in range(count):
        tokens += next(iterator)["input_ids"].numel()
    return tokens / (time.perf_counter() - start)


class OneRank:
    """What StreamLoader reads of its Accelerator: rank 0 of one process, on CPU."""

    process_index, num_processes, non_blocking = 0, 1, False

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")


def delivered(corpus: Path, shards: Path, args: argparse.Namespace) -> tuple[dict[str, float], int]:
    """Tokens/s each data path hands one rank, through train.py's loaders; and what the streaming loader added to
    this process's resident memory (its shuffle buffer of 1,000 sequences, the reader's chunks)."""
    from transformers import default_data_collator

    from data import build_lm_datasets, load_raw_datasets
    from parts.pretokenized.shards import load_shards
    from parts.streaming.documents import document_streams, stream_datasets
    from models.language import build_tokenizer
    from training.setup import training_loader
    from parts.streaming.loader import StreamLoader

    os.environ.update(ONE_CORE)
    tokenizer, batch, count = build_tokenizer(None, None), args.per_device_train_batch_size, args.data_batches
    in_memory, _ = build_lm_datasets(load_raw_datasets(None, None, None, None, 5, 42), tokenizer, "text", args.block_size)
    streams = document_streams(str(corpus), None, None, None, "text", False)
    stream, _ = stream_datasets(streams, tokenizer, "text", args.block_size, True, 42, None)
    prepared, _ = load_shards(str(shards), tokenizer, args.block_size, packing=True)
    before = psutil.Process().memory_info().rss
    loading = {"collate_fn": default_data_collator, "num_workers": 0}
    streaming = tokens_per_sec(StreamLoader(OneRank(), stream, batch, loading, 42, 1000, 60), count)
    return {
        "in memory": tokens_per_sec(training_loader(in_memory, batch, 42, collate_fn=default_data_collator), count),
        "streaming": streaming,
        "pre-tokenised": tokens_per_sec(training_loader(prepared, batch, 42, collate_fn=default_data_collator), count),
    }, psutil.Process().memory_info().rss - before


def prepare(corpus: Path, output: Path, num_proc: int, block_size: int) -> dict:
    """scripts/prepare_data.py on the corpus, as a user runs it; its figures."""
    figures = output.with_suffix(".json")
    command = [sys.executable, "scripts/prepare_data.py", "--dataset_name", str(corpus), "--block_size", str(block_size),
               "--num_proc", str(num_proc), "--output_dir", str(output), "--json", str(figures)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=os.environ | ONE_CORE)
    if result.returncode != 0:
        sys.exit(f"error: prepare_data.py failed:\n{result.stderr[-3000:]}")
    return json.loads(figures.read_text())


def data_table(args: argparse.Namespace, scratch: Path, train_run) -> tuple[list[str], dict]:
    """The table (see the module docstring); `train_run`: scripts/benchmark.py's, for the consumption figure."""
    corpus_bytes = write_corpus(scratch / "corpus", args.corpus_mb)
    preparing = {num_proc: prepare(scratch / "corpus", scratch / f"shards{num_proc}", num_proc, args.block_size)
                 for num_proc in (1, 2)}
    rates, stream_memory = delivered(scratch / "corpus", scratch / "shards1", args)
    consumed = train_run("single", args, scratch / "training", processes=1)["tokens_per_sec"]
    tokens = preparing[1]["tokens"]
    lines = [f"data: {corpus_bytes / 2**20:,.0f} MB of jsonl in {SHARDS} shards ({tokens:,} tokens), "
             f"{args.per_device_train_batch_size} x {args.block_size} tokens per micro-batch; training consumes "
             f"{consumed:,.0f} tokens/s per rank ({args.model_config}, {args.mixed_precision}, 1 process)", "",
             "| data path | tokens/s per rank | x what training consumes |", "|---|---:|---:|",
             *(f"| {name} | {rate:,.0f} | {rate / consumed:,.1f}x |" for name, rate in rates.items()), "",
             "| scripts/prepare_data.py | tokens/s | seconds | speed-up |", "|---|---:|---:|---:|",
             *(f"| --num_proc {n} | {p['tokens_per_sec']:,.0f} | {p['tokenise_seconds']:,.1f} | "
               f"{p['tokens_per_sec'] / preparing[1]['tokens_per_sec']:.2f}x |" for n, p in preparing.items()), "",
             f"streaming loader: {stream_memory / 2**20:,.0f} MiB more resident memory after {args.data_batches} batches"]
    return lines, {"data": {"delivered_tokens_per_sec": rates, "consumed_tokens_per_sec": consumed,
                            "prepare": preparing, "corpus_bytes": corpus_bytes, "streaming_loader_rss_bytes": stream_memory}}
