"""Launched by tests/test_streaming.py in 2 real processes under an accelerate config.

Each rank builds the Accelerator as train.py does and reads READS sequences of its share of a --streaming
training set through train.py's own loader (parts/streaming/loader.py), one per micro-batch, unpacked
(--packing false: one sequence per document), then writes OUT_DIR/rank_<rank>.json: per epoch, the first
4 token ids of each sequence it read. Arguments: OUT_DIR READS TRAIN_FLAGS (train.py's data flags).
"""

import json
import os
import sys
from pathlib import Path

from parts.streaming.loader import StreamLoader
from training.arguments import parse_args
from training.process_exit import exit_process
from training.strategy.accelerator import build_accelerator
from training.task_registry import build_task

EPOCHS = 2
out_dir, reads, train_flags = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]  # reads: more than EPOCHS passes hold
model_args, data_args, args = parse_args(["--model_config", "llama-tiny", "--streaming", "--packing", "false",
                                          "--max_steps", "1", "--eval_strategy", "no", "--ddp_timeout", "60",
                                          "--output_dir", str(out_dir), *train_flags])
accelerator = build_accelerator(args)
task = build_task(model_args, data_args)
raw = task.load_raw_datasets(args.seed)
task.build_model(raw)
train_stream, _ = task.datasets(raw, accelerator.main_process_first())
loader = StreamLoader(accelerator, train_stream, 1, {"collate_fn": lambda blocks: blocks, "num_workers": 0}, args.seed,
                      data_args.parts.streaming.shuffle_buffer_size, args.ddp_timeout)
seen: list[list[list[int]]] = [[] for _ in range(EPOCHS)]
batches = iter(loader)
for _ in range(reads):  # as many on every rank: each read is a collective (the ranks agree that all have one)
    (block,) = next(batches)
    if loader.epoch < EPOCHS:  # the pass the sequence just read belongs to
        seen[loader.epoch].append([int(token) for token in block["input_ids"][:4]])
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"rank_{os.environ['RANK']}.json").write_text(json.dumps(seen))
accelerator.wait_for_everyone()
exit_process(0)  # as train.py ends (training/process_exit.py)
