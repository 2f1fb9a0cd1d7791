"""Losses as per-example sums and target counts, so that every split of a global batch agrees.

A causal LM's targets are its tokens; an image classifier's, its images. Either way the
loss of a step is (sum over the global batch) / (targets in the global batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from training.errors import NonFiniteLossError

IGNORE_INDEX = -100  # label of padding and of anything else that must not be learned


def token_loss_sums(logits: torch.Tensor, labels: torch.Tensor,
                    label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum of next-token losses (cross-entropy, with `label_smoothing` if a task trains with it), and
    per-sequence count of target tokens."""
    # Each position's target is the next token; the last position has none (ignored). Over the logits as they
    # are, one row per token: no copy of them, and 2.7x faster on CPU than over a (batch, vocab, tokens) view
    # of them (measured at a 32k vocabulary).
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none",
                             label_smoothing=label_smoothing)
    return losses.view(targets.shape).sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)


def count_target_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Target tokens in a batch: what the loss is averaged over."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def correct_next_tokens(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sequence count of target tokens the model ranks first."""
    targets = labels[:, 1:]
    return ((logits[:, :-1].argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum(dim=1)


def class_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example cross-entropy, and a count of one target per example (none for an ignored label)."""
    return F.cross_entropy(logits.float(), labels, reduction="none"), (labels != IGNORE_INDEX).long()


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


class NonFiniteGuard:
    """Remembers the first step whose loss was not finite, without a host sync per step.

    `check`, on every rank's `local()` state gathered, runs before anything is logged, saved or
    exported, so poisoned weights never reach a checkpoint.

    Under fp16 (`loss_scaling`) an infinite gradient norm is normal now and then: the loss
    scaler (torch's GradScaler, or DeepSpeed's) found the scaled gradients overflowed, skipped
    the update (the fused AdamW inside its kernel, so `optimizer_step_was_skipped` cannot
    see it) and halved its scale. Those steps are counted (`skipped_steps`) and stop the
    run only MAX_SKIPPED_IN_A_ROW times in a row: by then the scale has fallen from 2**16
    to below 2**-4, and the gradients themselves are not finite. A non-finite loss always stops it.
    """

    NONE = 2**62
    MAX_SKIPPED_IN_A_ROW = 20

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
        """What goes with the training metrics: under fp16, the steps the loss scaler skipped so far.
        `ranks`: `gather_scalars` of `local()`."""
        return {"skipped_steps": int(ranks["skipped_steps"].max())} if self.loss_scaling else {}

    def check(self, ranks: dict[str, torch.Tensor]) -> None:
        """Raise if any rank saw a non-finite step. `ranks`: `gather_scalars` of `local()`."""
        first = int(ranks["first_bad_step"].min())
        if first != self.NONE:
            what = (f"the loss became non-finite, or fp16 overflowed {self.MAX_SKIPPED_IN_A_ROW} steps in a row "
                    "(bf16 does not overflow)" if self.loss_scaling else "the loss or gradient norm became non-finite")
            raise NonFiniteLossError(
                f"{what} (NaN or inf) at step {first}; stopped without saving anything from that step on. "
                "Lower --learning_rate, keep --max_grad_norm > 0, or resume from an earlier checkpoint"
            )


def label_loss_sums(task, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The task's own objective (`Task.objective_sums`: its label loss unless it trains on another), per example
    (a part may replace it: training/parts.py)."""
    return task.objective_sums(task.forward(model, batch), batch)


def forward_backward(accelerator, objective: Callable[[torch.nn.Module, dict], torch.Tensor], model: torch.nn.Module,
                     accumulation: int, batch: dict, window_targets: torch.Tensor) -> torch.Tensor:
    """One micro-step under every data-parallel strategy: forward, loss, backward; returns this process's
    share of the step's loss. (A part's ModelRunner runs its own: training/parts.py.)

    `objective` gives per-example loss sums. The loss is the mean over every target (token, or image)
    of the global batch (all micro-batches on all ranks), not a mean of per-batch means, so padded
    batches weigh by their tokens. The logits live only inside `objective` (e.g. tokens x vocabulary
    floats: freed before the backward's gradients pile up)."""
    loss = objective(model, batch).sum() / window_targets
    # Every strategy averages gradients over micro-steps and processes; scale back up so the
    # update is the gradient of the global token mean. (Tensor parallelism averages over
    # data-parallel ranks only, and its tp ranks each counted the window's targets.)
    accelerator.backward(loss * accumulation * accelerator.num_processes)
    return loss.detach()
