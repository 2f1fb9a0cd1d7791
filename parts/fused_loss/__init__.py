"""The causal LM's training loss fused with its output layer (`--fused_linear_cross_entropy`): computed from the
last hidden states in chunks, so the (tokens x vocabulary) logits, and their fp32 copy, never exist in a training
step. torch's `F.linear_cross_entropy` computes it, or Liger's Triton kernel under --use_liger_kernel. For eager
runs: --torch_compile fuses the loss with the model itself. Measured and tested: docs/fused_loss.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from training.parts import Conflict, Flags, Part, Plan, Started, Training, installed


@dataclass
class FusedLossFlags:
    fused_linear_cross_entropy: bool = field(default=False, metadata={
        "help": "The causal LM's training loss computed from the last hidden states in chunks, with the output "
                "layer: the logits are never made (torch's F.linear_cross_entropy; Liger's kernel with "
                "--use_liger_kernel). Evaluation still computes the logits."})


def output_layer(task, module):
    """The model's `nn.Linear` output layer, which computes the loss; refused in one line for a task with its own
    forward or objective, or a model without such a layer."""
    import torch

    from training.errors import ArgumentError
    from training.tasks import next_token_loss_as_is

    if not next_token_loss_as_is(task):
        raise ArgumentError(f"--fused_linear_cross_entropy computes the causal LM's next-token cross-entropy; task "
                            f"{task.name} has its own forward or objective: drop the flag")
    layer = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if not isinstance(layer, torch.nn.Linear):
        raise ArgumentError(f"--fused_linear_cross_entropy needs a model whose get_output_embeddings() is an "
                            f"nn.Linear (a transformers causal LM); {type(module).__name__} has none: drop the flag")
    return layer


def loss_kernel(args) -> tuple[Callable, str]:
    """The kernel that computes the loss, and its description; refused where none can run."""
    import torch

    from parts.fused_loss.head import CHUNK_ROWS, liger_kernel, torch_kernel
    from training.errors import ArgumentError

    if installed("liger") and args.parts.liger.use_liger_kernel:
        return liger_kernel, "Liger's fused kernel"
    if not hasattr(torch.nn.functional, "linear_cross_entropy"):
        raise ArgumentError(f"--fused_linear_cross_entropy needs torch 2.13's F.linear_cross_entropy (this is torch "
                            f"{torch.__version__}): install the pinned torch, or add --use_liger_kernel on an NVIDIA GPU")
    return torch_kernel, f"torch's F.linear_cross_entropy, {CHUNK_ROWS} tokens per chunk"


class FusedLoss(Part):
    name = "fused_loss"
    description = "the causal LM's loss fused with its output layer, no logits (--fused_linear_cross_entropy)"
    flags = FusedLossFlags
    conflicts = tuple(Conflict("fused_linear_cross_entropy", other, ": drop one")
                      for other in ("torch_compile", "teacher_model_name_or_path"))  # each computes the loss itself

    def check_flags(self, flags: Flags) -> None:
        """Refused where the training step computes its loss another way: torch.compile's graph (which fuses the
        loss itself), distillation's objective, a model split over stages, devices or tensor-parallel ranks."""
        from training.arguments import split_model
        from training.errors import ArgumentError

        if not flags.train.parts.fused_loss.fused_linear_cross_entropy:
            return
        if split := split_model(flags):
            raise ArgumentError(f"--fused_linear_cross_entropy with {split} is not supported: drop one")

    def started(self, run: Started) -> str | None:
        """The start-up line that says the flag took effect."""
        if not run.args.parts.fused_loss.fused_linear_cross_entropy:
            return None
        kernel = loss_kernel(run.args)[1]
        return f"--fused_linear_cross_entropy: the training loss is computed with the output layer ({kernel}); no logits"

    def training_objective(self, objective, training: Training):
        """The task's loss sums computed by the model's output layer, under --fused_linear_cross_entropy, in place of
        `objective` (the task's: the declared conflicts leave no other)."""
        if not training.args.parts.fused_loss.fused_linear_cross_entropy:
            return objective
        from parts.fused_loss.head import LossHead
        from training.strategy import bare_model

        layer = output_layer(training.task, bare_model(training.accelerator, training.model))
        return partial(LossHead(layer, loss_kernel(training.args)[0]).loss_sums, training.task)

    def dry_run_line(self, plan: Plan) -> str | None:
        """The same refusals as a run's, and what computes the loss."""
        if not plan.args.parts.fused_loss.fused_linear_cross_entropy:
            return None
        output_layer(plan.task, plan.model)
        return f"loss:            fused with the output layer ({loss_kernel(plan.args)[1]}); no logits"


PART = FusedLoss()
