"""Losses as per-example sums and target counts, so that every split of a global batch agrees.

A causal LM's targets are its tokens; an image classifier's, its images. Either way the
loss of a step is (sum over the global batch) / (targets in the global batch).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # label of padding and of anything else that must not be learned


def token_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum of next-token losses, and per-sequence count of target tokens."""
    targets = labels[:, 1:]
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return losses.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)


def count_target_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Target tokens in a batch: what the loss is averaged over."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def correct_next_tokens(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sequence count of target tokens the model ranks first."""
    targets = labels[:, 1:]
    return ((logits[:, :-1].argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum(dim=1)


def class_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example cross-entropy, and a count of one target per example."""
    return F.cross_entropy(logits.float(), labels, reduction="none"), torch.ones_like(labels)


def accumulation_windows(batches: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """Group micro-batches into the windows of one optimizer step each.

    The whole window is read first because the loss divides by its token count. train.py
    only ever sees full windows (it drops the incomplete last global batch of an epoch).
    """
    window = []
    for batch in batches:
        window.append(batch)
        if len(window) == size:
            yield window
            window = []
    if window:
        raise RuntimeError(f"an incomplete accumulation window of {len(window)} micro-batches: the data was not cut to full global batches")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; nothing was saved from the poisoned weights."""


class NonFiniteGuard:
    """Remembers the first step whose loss was not finite, without a host sync per step.

    `check` (a collective: call it on every rank) runs before anything is logged, saved or
    exported, so poisoned weights never reach a checkpoint.
    """

    NONE = 2**62

    def __init__(self, device: torch.device) -> None:
        self.first_bad_step = torch.full((), self.NONE, dtype=torch.long, device=device)

    def update(self, step: int, *values: torch.Tensor | float) -> None:
        """Record `step` if any value (the loss, the gradient norm) is NaN or infinite."""
        device = self.first_bad_step.device
        # FSDP2 returns the norm as a replicated DTensor: its local value is the whole norm.
        tensors = [torch.as_tensor(v.to_local() if hasattr(v, "to_local") else v, device=device) for v in values]
        bad_now = torch.stack([~torch.isfinite(t.detach().float()) for t in tensors]).any()
        self.first_bad_step = torch.where(bad_now, torch.clamp(self.first_bad_step, max=step), self.first_bad_step)

    def check(self, accelerator) -> None:
        first = int(accelerator.gather(self.first_bad_step.reshape(1)).min())
        if first != self.NONE:
            raise NonFiniteLossError(
                f"the loss or gradient norm became non-finite (NaN or inf) at step {first}; stopped without saving "
                "anything from that step on. Lower --learning_rate, keep --max_grad_norm > 0, or resume from an "
                "earlier checkpoint"
            )
