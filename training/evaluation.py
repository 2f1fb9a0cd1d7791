"""Validation loss and perplexity over the whole validation set, on every rank."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from training.loss import token_loss_sums


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataloader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
    """Token-weighted mean loss over every validation token, gathered across ranks.

    Every rank runs every batch (sharded models need all ranks in each forward), and
    `gather_for_metrics` drops the samples accelerate duplicated to even out the last
    batch, so the result equals a single-process evaluation.
    """
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    token_count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for batch in dataloader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        sums, counts = accelerator.gather_for_metrics(token_loss_sums(logits, batch["labels"]))
        loss_sum += sums.double().sum()
        token_count += counts.double().sum()
    model.train()
    eval_loss = (loss_sum / token_count).item()
    return {"eval_loss": eval_loss, "perplexity": math.exp(eval_loss) if eval_loss < 700 else math.inf}
