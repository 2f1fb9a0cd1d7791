"""One optimizer step, whole, in the order it runs: the micro-step's objective (the task's loss sums as the parts make
them: `training_objective`), then per window of micro-batches (`accumulation_windows`): forward and backward of each
(`forward_backward`) and the parts' `after_backward`, clipping (`clip_gradients`), the optimizer step, the scheduler
step and the step counters, the non-finite check (`NonFiniteGuard`), and the parts' `after_optimizer_step`. train.py's
loop calls `optimizer_step` once per window. Under DeepSpeed the engine clips and steps inside `accelerator.backward`
of the window's last micro-batch (accelerate calls `engine.step()` there), so `clip_gradients` reads the norm it
measured and `optimizer.step()` is a no-op; every other strategy clips and steps in the calls that name it. A part's
runner (pipeline stages: training/runner.py) does the forward/backward and the clipping its own way; the rest is the
same."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from training.errors import NonFiniteLossError
from training.parts import MicroStep, OptimizerStep, Training, parts
from training.strategy import Strategy, wrapped_strategy

if TYPE_CHECKING:
    from training.setup import Run


def training_objective(training: Training) -> Callable[[torch.nn.Module, dict], torch.Tensor]:
    """The micro-step's loss sums `objective(model, batch)`: the task's, as the parts replace (a fused loss), wrap or
    compile it (`Part.training_objective`)."""
    return parts().training_objective(partial(objective_sums, training.task), training)


def objective_sums(task, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """`Task.objective_sums` of the model's forward: the task's objective per example (a part may replace it)."""
    return task.objective_sums(task.forward(model, batch), batch)


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


def optimizer_step(run: Run, window: list[dict], nonfinite: NonFiniteGuard) -> tuple[torch.Tensor, torch.Tensor | float,
                                                                                   list[float]]:
    """One optimizer step over a window of micro-batches, the schedule and counters moved on; returns the step's loss
    (on the device), the gradient norm before clipping, and the learning rate each parameter group's update used."""
    accelerator, task, model, runner = run.accelerator, run.task, run.model, run.runner
    # The loss is the mean over every target (token, or image) of the global batch: each
    # micro-batch's loss sum is divided by the count over the whole window on all ranks.
    targets = [task.count_targets(batch) for batch in window]
    window_targets = accelerator.reduce(sum(targets), "sum")
    clip_norm = run.args.max_grad_norm if run.args.max_grad_norm > 0 else math.inf  # inf: measure, never clip
    step_loss, grad_norm = torch.zeros((), device=accelerator.device), math.nan
    for batch, batch_targets in zip(window, targets):
        with accelerator.accumulate(model):
            step_loss += runner.forward_backward(model, run.objective, batch, window_targets)  # no host sync here
            parts().after_backward(MicroStep(accelerator, model, batch, batch_targets, window_targets,
                                             accelerator.sync_gradients))
            if accelerator.sync_gradients:
                grad_norm = runner.clip_gradients(model, clip_norm)
            run.optimizer.step()  # (DeepSpeed stepped inside backward: a no-op)
            run.optimizer.zero_grad()
    rates = run.scheduler.get_last_lr()  # the rates this step's update used
    run.scheduler.step()
    run.state.completed_steps += 1
    run.state.steps_in_epoch += 1
    skipped = nonfinite.update(run.state.completed_steps, step_loss, grad_norm)
    parts().after_optimizer_step(OptimizerStep(accelerator, model, run.torch_optimizer, run.scheduler,
                                               run.state.completed_steps, grad_norm, skipped))
    return step_loss, grad_norm, rates


def forward_backward(accelerator: Accelerator, objective: Callable[[torch.nn.Module, dict], torch.Tensor], model: torch.nn.Module,
                     accumulation: int, batch: dict, window_targets: torch.Tensor) -> torch.Tensor:
    """One micro-step; returns this process's share of the step's loss: the mean over every target of the global batch,
    so padded batches weigh by their tokens. Logits live only inside `objective`, freed before backward's gradients."""
    loss = objective(model, batch).sum() / window_targets
    # Strategies average gradients over micro-steps and processes; scale up to the global token mean's gradient.
    # (Tensor parallelism averages over data-parallel ranks only, and its tp ranks each counted the targets.)
    accelerator.backward(loss * accumulation * accelerator.num_processes)
    return loss.detach()


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor | float:
    """The norm before clipping, on the device (DeepSpeed clips in its step; accelerate's `.item()` would sync)."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        return model.get_global_grad_norm()
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    return norm.to_local() if hasattr(norm, "to_local") else norm  # FSDP2's, a replicated DTensor: the whole norm


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

    def update(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float) -> torch.Tensor | bool:
        """Record `step` if the loss, or (without loss scaling) the gradient norm, is NaN or infinite; returns
        whether the loss scaler skipped this step's update (a device tensor under fp16, else False)."""
        loss_bad, norm_bad = (~torch.isfinite(self._tensor(value)) for value in (loss, grad_norm))
        skipped = False
        if self.loss_scaling:
            skipped = norm_bad & ~loss_bad
            self.skipped_steps += skipped
            self.skipped_in_a_row = torch.where(skipped, self.skipped_in_a_row + 1, 0)
            bad_now = loss_bad | (self.skipped_in_a_row >= self.MAX_SKIPPED_IN_A_ROW)
        else:
            bad_now = loss_bad | norm_bad
        self.first_bad_step = torch.where(bad_now, torch.clamp(self.first_bad_step, max=step), self.first_bad_step)
        return skipped

    def _tensor(self, value: torch.Tensor | float) -> torch.Tensor:
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
