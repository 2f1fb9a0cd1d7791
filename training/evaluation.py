"""Validation loss and accuracy over the whole validation set, on every rank."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from training.batchnorm import average_running_statistics
from training.tasks import Task


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataloader: DataLoader, accelerator: Accelerator, task: Task,
             ranks_per_batch: int = 1) -> dict[str, float]:
    """Target-weighted mean loss and accuracy over every validation target, gathered across ranks.

    Every rank runs every batch (sharded models need all ranks in each forward), and
    `gather_for_metrics` drops the samples accelerate duplicated to even out the last
    batch, so the result equals a single-process evaluation (`ranks_per_batch`: ranks that
    read the same batches, a tensor-parallel group, are counted once).
    """
    average_running_statistics(model, accelerator)  # every rank evaluates the same model
    model.eval()
    totals = None  # the task's named sums (`Task.eval_sums`), as one float64 column each
    for batch in dataloader:
        sums = task.eval_sums(task.forward(model, batch), batch)
        per_example = torch.stack([value.double() for value in sums.values()], dim=1)
        batch_totals = gather_once_per_batch(per_example, accelerator, ranks_per_batch).sum(dim=0)
        totals = batch_totals if totals is None else totals + batch_totals
    generated = task.generation_metrics(model, accelerator)
    model.train()
    return task.eval_metrics(dict(zip(sums, totals.tolist()))) | generated


def gather_once_per_batch(per_example: torch.Tensor, accelerator: Accelerator, ranks_per_batch: int) -> torch.Tensor:
    """`gather_for_metrics`, counting the batch of each group of `ranks_per_batch` neighbouring ranks once:
    accelerate 1.15's `gather_for_metrics` would count them all and cut the last batch at the wrong place."""
    if ranks_per_batch == 1:
        return accelerator.gather_for_metrics(per_example)
    gathered = accelerator.gather(per_example)  # rank order: the ranks of one batch are neighbours
    gathered = gathered.view(accelerator.num_processes, -1, *per_example.shape[1:])[::ranks_per_batch].flatten(0, 1)
    state = accelerator.gradient_state
    return gathered[: state.remainder] if state.end_of_dataloader and state.remainder > 0 else gathered
