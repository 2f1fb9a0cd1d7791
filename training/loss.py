"""Losses as per-example sums and target counts (tokens, or images): a step's loss is the global batch's sum over its
targets, so every split of the batch agrees."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from training.errors import NonFiniteLossError

IGNORE_INDEX = -100  # label of padding and of anything else that must not be learned


def token_loss_sums(logits: torch.Tensor, labels: torch.Tensor,
                    label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of next-token cross-entropy (with any `label_smoothing`), and counts of target tokens."""
    # Over the logits as they are, one row per token: no copy, and 2.7x faster on CPU than over a (batch, vocab,
    # tokens) view (measured at a 32k vocabulary).
    targets = next_token_targets(labels)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none",
                             label_smoothing=label_smoothing)
    return losses.view(targets.shape).sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target, the next token: the last position has none."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def count_target_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def correct_next_tokens(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sequence count of target tokens the model ranks first."""
    targets = labels[:, 1:]
    return ((logits[:, :-1].argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum(dim=1)


def class_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example cross-entropy, and a count of one target per example (none for an ignored label)."""
    return F.cross_entropy(logits.float(), labels, reduction="none"), (labels != IGNORE_INDEX).long()


def accumulation_windows(batches: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """Micro-batches by optimizer step, read whole: the loss divides by their token count (train.py drops partials)."""
    window = []
    for batch in batches:
        window.append(batch)
        if len(window) == size:
            yield window
            window = []
    if window:
        raise RuntimeError(f"an incomplete accumulation window of {len(window)} micro-batches: the data was not cut to full global batches")


class NonFiniteGuard:
    """The first non-finite step, without a host sync; `check` runs before any log or save. Under fp16 an inf grad norm
    is a skipped step (fused AdamW hides it from `optimizer_step_was_skipped`): fatal MAX_SKIPPED_IN_A_ROW in a row."""

    NONE = 2**62
    MAX_SKIPPED_IN_A_ROW = 20  # in a row: the loss scale falls from 2**16 to below 2**-4

    def __init__(self, device: torch.device, loss_scaling: bool = False) -> None:
        self.loss_scaling = loss_scaling
        self.first_bad_step = torch.full((), self.NONE, dtype=torch.long, device=device)
        self.skipped_steps = torch.zeros((), dtype=torch.long, device=device)
        self.skipped_in_a_row = torch.zeros((), dtype=torch.long, device=device)

    def update(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float) -> None:
        """Record `step` if the loss, or (without loss scaling) the gradient norm, is NaN or infinite."""
        loss_bad, norm_bad = (~torch.isfinite(self._tensor(value)) for value in (loss, grad_norm))
        if self.loss_scaling:
            skipped = norm_bad & ~loss_bad
            self.skipped_steps += skipped
            self.skipped_in_a_row = torch.where(skipped, self.skipped_in_a_row + 1, 0)
            bad_now = loss_bad | (self.skipped_in_a_row >= self.MAX_SKIPPED_IN_A_ROW)
        else:
            bad_now = loss_bad | norm_bad
        self.first_bad_step = torch.where(bad_now, torch.clamp(self.first_bad_step, max=step), self.first_bad_step)

    def _tensor(self, value: torch.Tensor | float) -> torch.Tensor:
        # FSDP2 returns the norm as a replicated DTensor: its local value is the whole norm.
        value = value.to_local() if hasattr(value, "to_local") else value
        return torch.as_tensor(value, device=self.first_bad_step.device).detach().float()

    def local(self) -> dict[str, torch.Tensor]:
        """This rank's state, for `collectives.gather_scalars` (still on the device: no wait)."""
        return {"first_bad_step": self.first_bad_step, "skipped_steps": self.skipped_steps}

    def logged(self, ranks: dict[str, torch.Tensor]) -> dict[str, int]:
        """Under fp16, the steps the loss scaler skipped so far, for the training metrics; `ranks`: as in `check`."""
        return {"skipped_steps": int(ranks["skipped_steps"].max())} if self.loss_scaling else {}

    def check(self, ranks: dict[str, torch.Tensor]) -> None:
        """Raise if any rank saw a non-finite step. `ranks`: `gather_scalars` of `local()`."""
        first = int(ranks["first_bad_step"].min())
        if first != self.NONE:
            what = (f"the loss became non-finite, or fp16 overflowed {self.MAX_SKIPPED_IN_A_ROW} steps in a row "
                    "(bf16 does not overflow)" if self.loss_scaling else "the loss or gradient norm became non-finite")
            raise NonFiniteLossError(
                f"{what} (NaN or inf) at step {first}; stopped without saving anything from that step on. Lower "
                "--learning_rate, keep --max_grad_norm > 0, or resume from an earlier checkpoint")


def label_loss_sums(task, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The task's objective per example (`Task.objective_sums`); a part may replace it (training/parts.py)."""
    return task.objective_sums(task.forward(model, batch), batch)


def forward_backward(accelerator, objective: Callable[[torch.nn.Module, dict], torch.Tensor], model: torch.nn.Module,
                     accumulation: int, batch: dict, window_targets: torch.Tensor) -> torch.Tensor:
    """One micro-step; returns this process's share of the step's loss: the mean over every target of the global batch,
    so padded batches weigh by their tokens. Logits live only inside `objective`, freed before backward's gradients."""
    loss = objective(model, batch).sum() / window_targets
    # Strategies average gradients over micro-steps and processes; scale up to the global token mean's gradient.
    # (Tensor parallelism averages over data-parallel ranks only, and its tp ranks each counted the targets.)
    accelerator.backward(loss * accumulation * accelerator.num_processes)
    return loss.detach()
