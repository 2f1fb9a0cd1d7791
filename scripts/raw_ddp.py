"""The loop a user would write by hand: plain PyTorch DDP under torchrun, no accelerate.

    torchrun --nproc_per_node 2 scripts/raw_ddp.py --model_config llama-small --steps 30

The yardstick for train.py's overhead (scripts/benchmark.py runs both, alternately): the
same model, data, batch shapes, AdamW, clipping and schedule, timed the same way (from step to step,
loading included). Prints one JSON line with the tokens/s over the steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import default_data_collator

from data import build_lm_datasets, load_raw_datasets
from models.language import build_model, build_tokenizer
from training.arguments import TrainArguments
from training.optim import build_optimizer, build_scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_config", default="llama-small")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="Steps left out of the rate (the first: start-up).")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as accelerate's --mixed_precision bf16.")
    parser.add_argument("--bf16_weights", action="store_true",
                        help="Instead of autocast, bf16 parameters (as FSDP2's and DeepSpeed's bf16 modes compute): "
                             "the speed of that forward and backward. Timing only: no fp32 master weights.")
    parser.add_argument("--config_overrides", help="As train.py's (e.g. vocab_size=50304).")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(minutes=10))  # never hang a benchmark
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    torch.manual_seed(42)

    tokenizer = build_tokenizer(None, None)
    model = build_model(None, args.model_config, tokenizer, config_overrides=args.config_overrides)
    model = model.to(device, torch.bfloat16 if args.bf16_weights else None)
    train_set, _ = build_lm_datasets(load_raw_datasets(None, None, None, None, 5, 42), tokenizer, "text", args.block_size)
    loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, collate_fn=default_data_collator,
                        sampler=DistributedSampler(train_set, world, rank, seed=42), drop_last=True)
    model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    settings = TrainArguments(learning_rate=1e-3, weight_decay=0.1, warmup_steps=3)  # train.py's defaults otherwise
    optimizer = build_optimizer(model, settings)
    scheduler = build_scheduler(optimizer, settings, total_steps=args.steps)

    # Timed as train.py's speed meter times: from one step's end to the next (its batch's loading included),
    # over every step after the warm-up: their tokens / their time (train.py's logged intervals add up the same).
    tokens, seconds, clock = 0, 0.0, time.perf_counter()
    for step, batch in zip(range(args.steps), loader):
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if on_gpu:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if step >= args.warmup:
            tokens, seconds = tokens + batch["input_ids"].numel(), seconds + now - clock
        clock = now
    rate = torch.tensor(tokens / seconds, device=device)
    dist.all_reduce(rate)  # every rank's tokens/s, summed: the global rate, as train.py reports
    if rank == 0:
        print(json.dumps({"tokens_per_sec": rate.item(), "steps": step + 1}), flush=True)
    dist.barrier()
    # Skip the teardown: gloo's process group, freed with DDP's reducer, can block forever joining
    # its threads once the peer has exited (torch 2.13, seen here); the OS frees it all anyway.
    os._exit(0)


if __name__ == "__main__":
    main()
