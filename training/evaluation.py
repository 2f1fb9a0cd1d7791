"""Validation loss and accuracy over the whole validation set, on every rank."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from training.batchnorm import average_running_statistics
from training.parts import ModelRunner
from training.tensor_parallel import gather_once_per_batch
from training.tasks import Task


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataloader: DataLoader, accelerator: Accelerator, task: Task) -> dict[str, float]:
    """Target-weighted mean loss and accuracy over every validation target, gathered across ranks.

    Every rank runs every batch (sharded models need all ranks in each forward), and
    `gather_for_metrics` drops the samples accelerate duplicated to even out the last
    batch, so the result equals a single-process evaluation (under tensor parallelism,
    with one rank per group counted).
    """
    average_running_statistics(model, accelerator)  # every rank evaluates the same model
    if isinstance(model, ModelRunner):  # a part's model that evaluates itself (pipeline stages)
        return model.evaluate(dataloader, accelerator, task)
    model.eval()
    totals = None  # the task's named sums (`Task.eval_sums`), as one float64 column each
    for batch in dataloader:
        sums = task.eval_sums(task.forward(model, batch), batch)
        per_example = torch.stack([value.double() for value in sums.values()], dim=1)
        batch_totals = gather_once_per_batch(per_example, accelerator).sum(dim=0)
        totals = batch_totals if totals is None else totals + batch_totals
    generated = task.generation_metrics(model, accelerator)
    model.train()
    return task.eval_metrics(dict(zip(sums, totals.tolist()))) | generated
