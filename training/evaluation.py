"""Validation loss and accuracy over the whole validation set, on every rank."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from training.batchnorm import average_running_statistics
from training.distributed import tensor_parallel_size
from training.tasks import Task


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataloader: DataLoader, accelerator: Accelerator, task: Task) -> dict[str, float]:
    """Target-weighted mean loss and accuracy over every validation target, gathered across ranks.

    Every rank runs every batch (sharded models need all ranks in each forward), and
    `gather_for_metrics` drops the samples accelerate duplicated to even out the last
    batch, so the result equals a single-process evaluation. Under tensor parallelism the
    ranks of one group see the same batch: one rank per group counts (accelerate 1.15's
    `gather_for_metrics` would count them all, and cut the last batch at the wrong place).
    """
    average_running_statistics(model, accelerator)  # every rank evaluates the same model
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, targets, right answers
    for batch in dataloader:
        logits = task.forward(model, batch)
        sums, counts = task.loss_sums(logits, batch)
        per_example = torch.stack([sums.double(), counts.double(), task.correct(logits, batch).double()], dim=1)
        totals += _gather_once_per_batch(per_example, accelerator).sum(dim=0)
    model.train()
    loss_sum, targets, right = totals.tolist()
    return task.eval_metrics(loss_sum / targets, right / targets)


def _gather_once_per_batch(per_example: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
    """`gather_for_metrics`, counting each tensor-parallel group's batch once."""
    tp_size = tensor_parallel_size(accelerator)
    if tp_size == 1:
        return accelerator.gather_for_metrics(per_example)
    gathered = accelerator.gather(per_example)  # rank order: the tp ranks of one batch are neighbours
    gathered = gathered.view(accelerator.num_processes, -1, *per_example.shape[1:])[::tp_size].flatten(0, 1)
    state = accelerator.gradient_state
    return gathered[: state.remainder] if state.end_of_dataloader and state.remainder > 0 else gathered
