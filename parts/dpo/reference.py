"""Owns DPO's reference model: the policy as it started, frozen, scoring every batch the policy scores.

- With an adapter (`--use_peft`), no second model: the policy with its adapter switched off (peft's
  `disable_adapter()`), through the same prepared model, so every strategy shards it as it shards the policy.
- Otherwise the policy's starting weights (`--model_name_or_path`), loaded again and placed by the strategy as
  the policy is (training/strategy/frozen.py, shared with distillation's teacher): a whole copy per rank under DDP
  and ZeRO-1/2, sharded under FSDP2 and ZeRO-3.
- `--reference_free`: none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from parts.dpo.loss import sequence_log_probs
from training.checkpoints.frozen import frozen_identity
from training.performance import storage_bytes
from training.strategy import bare_model
from training.strategy.frozen import frozen, place_frozen_model
from training.tasks import Batch, Task

Reference = Callable[[torch.nn.Module, Batch, bool], torch.Tensor]


def reference_log_probs(accelerator: Accelerator, task: Task, policy: torch.nn.Module) -> Reference | None:
    """The reference's log-probabilities of a batch's sequences, as (policy, batch, average) -> (sequences,)."""
    if task.dpo.reference_free:
        return None
    logger = get_logger(__name__)
    if hasattr(bare_model(accelerator, policy), "disable_adapter"):
        logger.info("DPO reference: the policy with its adapter off (no second model)", main_process_only=True)

        @torch.no_grad()
        def adapter_off(model: torch.nn.Module, batch: Batch, average: bool) -> torch.Tensor:
            with bare_model(accelerator, model).disable_adapter():
                return sequence_log_probs(model, batch, average)

        return adapter_off
    path = task.model_args.model_name_or_path
    with torch.random.fork_rng(devices=[]):  # loading draws nothing from the run's random numbers
        reference = frozen(task.auto_model.from_pretrained(path, dtype=torch.float32,
                                                           trust_remote_code=task.model_args.trust_remote_code))
    task.reference_identity = frozen_identity(path, reference, accelerator)  # (recorded in checkpoints: a resume checks it)
    reference = place_frozen_model(accelerator, reference)
    held = storage_bytes(reference.parameters(), set())
    logger.info(f"DPO reference: {path}, frozen, placed as {type(reference).__name__} ({held / 2**20:,.1f} MiB of "
                "weights on this rank)", main_process_only=True)

    @torch.no_grad()
    def loaded(model: torch.nn.Module, batch: Batch, average: bool) -> torch.Tensor:
        with accelerator.autocast():  # the policy's compute precision: accelerate wraps only what it prepared
            return sequence_log_probs(reference, batch, average)

    return loaded


TABLE_FILE = "dpo_reference_log_probs.safetensors"  # in a checkpoint, under --precompute_ref_log_probs
IDENTITY = "reference_model"  # <IDENTITY>.json in a checkpoint: the loaded reference's record; --allow_config_changes


def set_up_reference(accelerator: Accelerator, task: Task, policy: torch.nn.Module, args) -> None:
    """The task's reference: loaded and placed (or the policy with its adapter off), or under
    --precompute_ref_log_probs its scores of every pair, in one pass, the reference then freed."""
    reference = reference_log_probs(accelerator, task, policy)
    if not task.dpo.precompute_ref_log_probs:
        task.reference = reference
        return
    task.reference_table = precomputed_log_probs(accelerator, task, policy, reference, args.per_device_eval_batch_size)
    del reference  # the second model freed: the table holds all training needs of it
    get_logger(__name__).info(f"DPO reference: {len(task.reference_table):,} pairs scored once, then freed",
                              main_process_only=True)


@torch.no_grad()
def precomputed_log_probs(accelerator: Accelerator, task: Task, policy: torch.nn.Module, reference: Reference,
                          batch_size: int) -> torch.Tensor:
    """(pair_index, 2): the reference's log-probabilities of every training and validation pair's chosen and rejected
    answer, in one pass before training: each rank scores its share (the same number of batches on every rank, for
    a sharded reference), then every rank gathers the whole table."""
    pairs = [pair for split in task.pairs for pair in split]
    share = pairs[accelerator.process_index::accelerator.num_processes]
    share += share[-1:] * (-(-len(pairs) // accelerator.num_processes) - len(share))  # padded to an equal count
    average, rows = task.dpo.loss_type == "ipo", []
    for start in range(0, len(share), batch_size):
        batch = {key: value.to(accelerator.device) for key, value in task.collator(share[start:start + batch_size]).items()}
        chosen, rejected = reference(policy, batch, average).float().chunk(2)
        rows.append(torch.stack([batch["pair_index"].float(), chosen, rejected], dim=1))
    gathered = accelerator.gather(torch.cat(rows))
    table = torch.full((int(gathered[:, 0].max()) + 1, 2), float("nan"), device=accelerator.device)
    table[gathered[:, 0].long()] = gathered[:, 1:]
    return table
