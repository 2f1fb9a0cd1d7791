"""Recipe (c): your own training objective, label smoothing, while evaluation keeps the plain loss.

    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --task recipes.label_smoothing:LabelSmoothedLM

Training minimises `objective_sums`; `eval_loss` and perplexity come from `loss_sums`, which stays the task's
label loss, so runs with and without smoothing report comparable evaluations. A z-loss is the same override:
add `1e-4 * logits.float().logsumexp(-1).square()` summed over each sequence's targets.
"""

from __future__ import annotations

import torch

from training.loss import token_loss_sums
from training.tasks import CausalLM

SMOOTHING = 0.1


class LabelSmoothedLM(CausalLM):
    """The causal-LM task, trained with label smoothing."""

    def objective_sums(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """Per-sequence sums of the smoothed next-token loss (the step divides by the global batch's targets)."""
        return token_loss_sums(logits, batch["labels"], label_smoothing=SMOOTHING)[0]
