"""Owns DPO's formulas (Rafailov et al. 2023, and TRL's `DPOTrainer.dpo_loss`): the answers' log-probabilities, the
loss of each pair and its rewards, from the policy's and the reference's log-probabilities of the chosen and the
rejected answer.

    h = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected))
    sigmoid: -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)     (e: --label_smoothing, cDPO)
    hinge:   max(0, 1 - beta h)
    ipo:     (h - 1 / (2 beta))^2, with each log-probability the mean over the answer's tokens (IPO's)

rewards: beta (log pi - log ref) of each answer, detached. `--reference_free`: log ref = 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parts.dpo.flags import LOSS_TYPES

IGNORE_INDEX = -100


def answer_log_probs(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per sequence, the log-probability of its answer tokens (labels not -100, each predicted by the position
    before): their sum, or with `average` their mean. In fp32 whatever the logits' dtype."""
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    log_probs = torch.gather(F.log_softmax(logits[:, :-1].float(), dim=-1), 2,
                             torch.where(mask, targets, 0).unsqueeze(-1)).squeeze(-1)
    sums = torch.where(mask, log_probs, 0.0).sum(dim=1)
    return sums / mask.sum(dim=1).clamp(min=1) if average else sums


def sequence_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor], average: bool) -> torch.Tensor:
    """`answer_log_probs` of `model`'s logits for the batch's sequences."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return answer_log_probs(logits, batch["labels"], average)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair's loss, and its chosen and rejected rewards (detached)."""
    h = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
    rewards_chosen = beta * (policy_chosen - reference_chosen).detach()
    rewards_rejected = beta * (policy_rejected - reference_rejected).detach()
    return losses, rewards_chosen, rewards_rejected
