"""Recipe (d): your own evaluation metric, top-5 accuracy of the next token.

    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py --task recipes.top5_accuracy:Top5LM

`eval_sums` adds a named per-sequence count to what evaluation sums over the whole validation set on every rank
(gathered once, duplicates dropped); `eval_metrics` turns the totals into `eval_top5_accuracy`, which then appears
in metrics.jsonl, summary.json, the console summary, the trackers and report.png like the core's metrics.
"""

from __future__ import annotations

import torch

from training.loss import IGNORE_INDEX
from training.tasks import CausalLM


class Top5LM(CausalLM):
    """The causal-LM task, evaluated for top-5 accuracy too."""

    def eval_sums(self, logits: torch.Tensor, batch: dict) -> dict[str, torch.Tensor]:
        targets = batch["labels"][:, 1:]
        in_top5 = (logits[:, :-1].topk(5, dim=-1).indices == targets.unsqueeze(-1)).any(dim=-1)
        return super().eval_sums(logits, batch) | {"top5": (in_top5 & (targets != IGNORE_INDEX)).sum(dim=1)}

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        return super().eval_metrics(totals) | {"eval_top5_accuracy": totals["top5"] / totals["targets"]}
