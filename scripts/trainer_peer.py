"""What a user would pick instead of train.py: transformers' `Trainer` on the same model, data, batch and schedule.

    python scripts/trainer_peer.py --model_config llama-tiny --steps 150          # one process
    torchrun --nproc_per_node 2 scripts/trainer_peer.py --model_config llama-tiny  # DDP, as Trainer runs it

The peer `scripts/benchmark.py --peers` sets train.py against: the template's model (models/), its packed blocks of
the default corpus (data/), its AdamW settings, clipping and schedule, at Trainer's own speed defaults (its optimizer
choice, data loading and logging). Timed as train.py's speed meter times, from one step's end to the next over the
steps after warm-up, as the global rate; then evaluated on the same validation blocks. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the template's modules

from data import build_lm_datasets, load_raw_datasets  # noqa: E402
from models.language import build_model, build_tokenizer  # noqa: E402


class StepClock(TrainerCallback):
    """Seconds from each optimizer step's end to the next's, after the first `warmup` steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.seconds, self.steps, self.clock = warmup, 0.0, 0, None

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.clock is not None and state.global_step > self.warmup:
            self.seconds, self.steps = self.seconds + now - self.clock, self.steps + 1
        self.clock = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_config", default="llama-tiny")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5, help="Steps left out of the rate (the first: start-up).")
    parser.add_argument("--max_eval_samples", type=int, default=256)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(42)
    tokenizer = build_tokenizer(None, None)
    model = build_model(None, args.model_config, tokenizer)
    train_set, eval_set = build_lm_datasets(load_raw_datasets(None, None, None, None, 5, 42), tokenizer, "text",
                                            args.block_size)
    clock = StepClock(args.warmup)
    with tempfile.TemporaryDirectory() as scratch:
        settings = TrainingArguments(
            output_dir=scratch, max_steps=args.steps, per_device_train_batch_size=args.per_device_train_batch_size,
            per_device_eval_batch_size=args.per_device_train_batch_size, learning_rate=1e-3, weight_decay=0.1,
            adam_beta2=0.95, warmup_steps=max(1, args.steps // 10), lr_scheduler_type="linear", max_grad_norm=1.0,
            bf16=args.bf16, seed=42, logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[],
            disable_tqdm=True, dataloader_drop_last=True,
            # (on CPU Trainer runs each torchrun rank alone, untold: use_cpu and gloo make it DDP, MULTI_CPU)
            use_cpu=not torch.cuda.is_available(),
            ddp_backend="gloo" if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
        trainer = Trainer(model=model, args=settings, train_dataset=train_set, data_collator=default_data_collator,
                          eval_dataset=eval_set.select(range(min(args.max_eval_samples, len(eval_set)))),
                          callbacks=[clock])
        trainer.train()
        evaluation = trainer.evaluate()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = clock.steps * args.per_device_train_batch_size * args.block_size * world
    if trainer.is_world_process_zero():
        print(json.dumps({"tokens_per_sec": tokens / clock.seconds, "step_time": clock.seconds / clock.steps,
                          "eval_loss": evaluation["eval_loss"], "steps": args.steps, "processes": world,
                          "parallel_mode": settings.parallel_mode.value}), flush=True)


if __name__ == "__main__":
    main()
