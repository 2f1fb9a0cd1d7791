"""Owns how the core runs the model it trains, as one interface: `prepare`, one micro-step's forward and backward,
clipping, evaluation, a checkpoint's model state saved and loaded, and the export of `final/`. `ModelRunner` does
each for one module through accelerate, under every strategy; a part that runs the model its own way (pipeline
stages, each process holding some layers) returns a subclass from `Part.model_runner`, and the core never asks which
it has."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from training.checkpoints.save import export_whole_model
from training.checkpoints.tensors import MODEL_STATE, base_optimizer, load_model_state, save_model_state, set_next_rate
from training.evaluation import evaluate
from training.step import clip_gradients, forward_backward
from training.strategy.whole import kept_whole

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from training.tasks import Task


class ModelRunner:
    """One module trained through accelerate's `prepare` (DDP, FSDP2, DeepSpeed ZeRO); a part's runner overrides
    every method (each is handed the model the runner prepared)."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def prepare(self, model: torch.nn.Module, task: Task, seed: int, optimizer, train_loader, eval_loader,
                scheduler) -> tuple:
        """What `accelerator.prepare(model, optimizer, train_loader, eval_loader, scheduler)` returns (the parameters
        a strategy cannot shard kept whole: training/strategy/whole.py)."""
        with kept_whole(self.accelerator, model):
            return self.accelerator.prepare(model, optimizer, train_loader, eval_loader, scheduler)

    def forward_backward(self, model: torch.nn.Module, objective: Callable, batch: dict,
                         window_targets: torch.Tensor) -> torch.Tensor:
        """One micro-step: this process's share of the step's loss (training/step.py `forward_backward`)."""
        return forward_backward(self.accelerator, objective, model, self.accelerator.gradient_accumulation_steps,
                                batch, window_targets)

    def clip_gradients(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor | float:
        """Clip by the whole model's gradient norm (inf: measure only); the norm before clipping."""
        return clip_gradients(self.accelerator, model, max_norm)

    def evaluate(self, model: torch.nn.Module, dataloader: DataLoader, task: Task,
                 ranks_per_batch: int) -> dict[str, float]:
        """The task's metrics over the whole validation set (training/evaluation.py)."""
        return evaluate(model, dataloader, self.accelerator, task, ranks_per_batch)

    def save(self, model: torch.nn.Module, optimizer, directory: Path, stamp: dict[str, str]) -> dict[str, str] | None:
        """Every rank: the weights and optimizer state into the checkpoint being written (`model_state/`), the files
        saying which run and step they belong to (`stamp`, in their metadata); the SHA-256 of each file written and
        hashed meanwhile, by path within the checkpoint (a runner that returns None has its files hashed after)."""
        sha256 = save_model_state(self.accelerator, model, optimizer, directory / MODEL_STATE, stamp)
        return {f"{MODEL_STATE}/rank{self.accelerator.process_index}.safetensors": sha256}

    def load(self, model: torch.nn.Module, optimizer, scheduler, directory: Path) -> None:
        """Every rank: the weights and optimizer state from the checkpoint a run resumes, however it was laid out
        (a checkpoint before model_state/ was loaded whole by accelerate's `load_state`); `optimizer` None: the
        weights alone (an evaluation, under any --optim)."""
        if (directory / MODEL_STATE).is_dir():
            # (made and linked once: ZeRO's state, training/checkpoints/tensors.py)
            base = base_optimizer(optimizer) if optimizer is not None else None
            load_model_state(self.accelerator, model, base, directory)
            if base is not None:
                set_next_rate(base, getattr(scheduler, "scheduler", scheduler))

    def export(self, model: torch.nn.Module, task: Task, final_dir: Path) -> Path:
        """Every rank: the whole model in `final_dir`, as `transformers` (or, for a plain module, `load_plain_model`)
        loads it."""
        return export_whole_model(self.accelerator, model, task, final_dir)
