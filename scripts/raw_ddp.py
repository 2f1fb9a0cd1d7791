"""The loop a user would write by hand: plain PyTorch DDP under torchrun, no accelerate.

    torchrun --nproc_per_node 2 scripts/raw_ddp.py --model_config llama-small --steps 30

The yardstick for train.py's overhead (scripts/benchmark.py runs both, alternately): the
same model, data, batch shapes, AdamW, clipping and schedule, timed the same way (the
optimizer steps only). Prints one JSON line with the median tokens/s after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    parser.add_argument("--warmup", type=int, default=5, help="Steps left out of the median.")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as accelerate's --mixed_precision bf16.")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(minutes=10))  # never hang a benchmark
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    torch.manual_seed(42)

    tokenizer = build_tokenizer(None, None)
    model = build_model(None, args.model_config, tokenizer).to(device)
    train_set, _ = build_lm_datasets(load_raw_datasets(None, None, None, None, 5, 42), tokenizer, "text", args.block_size)
    loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, collate_fn=default_data_collator,
                        sampler=DistributedSampler(train_set, world, rank, seed=42), drop_last=True)
    model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    settings = TrainArguments(learning_rate=1e-3, weight_decay=0.1, warmup_steps=3)  # train.py's defaults otherwise
    optimizer = build_optimizer(model, settings)
    scheduler = build_scheduler(optimizer, settings, total_steps=args.steps)

    rates = []
    for step, batch in zip(range(args.steps), loader):
        start = time.perf_counter()
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
        rate = torch.tensor(batch["input_ids"].numel() / (time.perf_counter() - start), device=device)
        dist.all_reduce(rate)  # after the clock stopped, as train.py reports
        if step >= args.warmup:
            rates.append(rate.item())
    if rank == 0:
        print(json.dumps({"tokens_per_sec": statistics.median(rates), "steps": len(rates) + args.warmup}), flush=True)
    dist.barrier()
    # Skip the teardown: gloo's process group, freed with DDP's reducer, can block forever joining
    # its threads once the peer has exited (torch 2.13, seen here); the OS frees it all anyway.
    os._exit(0)


if __name__ == "__main__":
    main()
