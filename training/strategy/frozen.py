"""Owns the placement of a model that runs beside the trained one and is never trained (a distillation teacher, a
DPO reference): placed as the strategy places the trained model, and never registered with accelerate, so no
checkpoint or export holds it."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from training.performance import compute_dtype
from training.strategy.adapters import (
    answer_none_for_missing_embeddings,
    batch_norm_statistics_in,
    keep_batch_norm_in_fp32,
)


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """A model that is run, never trained: no gradients, eval mode (no dropout, BatchNorm's running statistics)."""
    return model.requires_grad_(False).eval()


def place_frozen_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """`model`, frozen, placed as the strategy places the trained model, and not registered with accelerate:
    `save_state` saves what `prepare` registered, and a teacher or a reference is an input, not state.

    - DDP, one process: a whole replica on each rank's device (autocast gives it the compute dtype).
    - FSDP2: sharded with the config's own settings (accelerate's `fsdp2_prepare_model`, which `prepare`
      calls for the trained model).
    - DeepSpeed: an inference engine (`deepspeed.initialize` without an optimizer), as TRL places its reference
      model: under ZeRO-3 partitioned too, gathered layer by layer in forward (the trained model's `stage3_*` and
      `offload_param` settings); under ZeRO-1/2, which keep whole weights, a whole copy in the compute dtype
      (stage 0). Not accelerate's second DeepSpeed plugin: `prepare` would register that engine, and every
      checkpoint would save the frozen model.
    """
    half = compute_dtype(accelerator.mixed_precision)
    if accelerator.distributed_type is DistributedType.FSDP:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        answer_none_for_missing_embeddings(model)
        if half is not torch.float32:
            keep_batch_norm_in_fp32(model, accelerator)
        return fsdp2_prepare_model(accelerator, model)
    if accelerator.state.deepspeed_plugin is not None:
        if half is not torch.float32:
            batch_norm_statistics_in(model, half)
        return _inference_engine(accelerator, model)
    return model.to(accelerator.device)


def _inference_engine(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    import deepspeed

    trained = accelerator.state.deepspeed_plugin.deepspeed_config  # resolved by `prepare`: no "auto" left
    sharded = accelerator.state.deepspeed_plugin.zero_stage == 3
    zero = {key: value for key, value in trained.get("zero_optimization", {}).items() if key.startswith("stage3_")
            or key == "offload_param"} if sharded else {}
    config = {key: trained[key] for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                             "gradient_accumulation_steps")}
    config |= {"zero_optimization": zero | {"stage": 3 if sharded else 0},
               "bf16": {"enabled": accelerator.mixed_precision == "bf16"},
               "fp16": {"enabled": accelerator.mixed_precision == "fp16"}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine
