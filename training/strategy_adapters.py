"""Owns every difference between strategies that code must handle, in one place.

What each needs before `prepare` so that it trains what train.py asks for
(`align_with_strategy`), and the few reads that differ per wrapper (gradient norm, input
dtype, held gradients, the dtype gradients are averaged in, saving an FSDP2 model)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from training.batchnorm import batch_norm_layers, running_statistics
from training.errors import StrategyError
from training.performance import compute_dtype
from training.parts import ModelRunner
from training.strategy import Strategy, wrapped_strategy


def optimizer_offload_device(accelerator: Accelerator) -> str:
    """Where ZeRO keeps and steps the optimizer: "cpu" or "nvme" under offload, else "none"."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return "none"
    return plugin.deepspeed_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")

def align_with_strategy(accelerator: Accelerator, model: torch.nn.Module, max_grad_norm: float, per_device_batch: int) -> None:
    """Before the optimizer and `prepare`: make the strategy run what train.py asks for (see each helper)."""
    half = compute_dtype(accelerator.mixed_precision)
    if accelerator.distributed_type is DistributedType.FSDP:
        answer_none_for_missing_embeddings(model)
        if accelerator.state.fsdp_plugin.cpu_ram_efficient_loading and (buffers := persistent_buffers(model)):
            raise StrategyError(
                f"fsdp_cpu_ram_efficient_loading broadcasts only parameters from rank 0, and this model has buffers "
                f"that are saved with it ({', '.join(buffers[:3])}...); set `fsdp_cpu_ram_efficient_loading: false` "
                "in the accelerate config (every rank then builds the whole model)"
            )
        if half is not torch.float32:
            keep_batch_norm_in_fp32(model, accelerator)
            _reduce_gradients_in_fp32(accelerator)
    if accelerator.state.deepspeed_plugin is not None:
        align_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, max_grad_norm, per_device_batch)
        if half is not torch.float32:
            batch_norm_statistics_in(model, half)

def persistent_buffers(model: torch.nn.Module) -> list[str]:
    """Names of the buffers in the model's state dict (BatchNorm statistics; not rotary tables)."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in model.state_dict() if name not in parameters]

def answer_none_for_missing_embeddings(model: torch.nn.Module) -> None:
    """accelerate 1.15's FSDP2 asks every model for its input embeddings, to shard them as a unit,
    expecting None from models without any (image models); `transformers` raises instead."""
    try:
        model.get_input_embeddings()
    except (NotImplementedError, AttributeError):  # (a plain nn.Module has no such method: accelerate then skips it)
        model.get_input_embeddings = lambda: None

def _reduce_gradients_in_fp32(accelerator: Accelerator) -> None:
    """accelerate's FSDP2 policy for bf16/fp16 also reduces gradients in that dtype: a sum over
    many ranks in 8 bits of mantissa. Compute stays in half precision; the reduce-scatter runs in
    fp32, as torchtitan's default, and as DDP's (whose gradients are the fp32 parameters')."""
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version == 2 and plugin.mixed_precision_policy is not None:
        plugin.mixed_precision_policy = dataclasses.replace(plugin.mixed_precision_policy, reduce_dtype=torch.float32)

def gradient_reduction_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The dtypes the ranks average gradients in: FSDP2's policy per unit, DeepSpeed's
    `communication_data_type` (bf16 under bf16, DeepSpeed's default), else the parameters'."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        return {model.communication_data_type}
    states = [module._get_fsdp_state() for module in model.modules() if hasattr(module, "_get_fsdp_state")]
    if states:  # no reduce_dtype: the param_dtype, else the (fp32) parameters'
        return {state._mp_policy.reduce_dtype or state._mp_policy.param_dtype or torch.float32 for state in states}
    return {param.dtype for param in model.parameters() if param.requires_grad}

def keep_batch_norm_in_fp32(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """FSDP2's mixed precision casts BatchNorm weights to bf16 while its running statistics stay
    fp32, which BatchNorm refuses (pytorch/torchtitan#674). Each BatchNorm becomes its own FSDP2
    unit computing in fp32, as autocast runs it under DDP; accelerate wraps the rest as usual."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in batch_norm_layers(model):
        fully_shard(layer, mp_policy=fp32, reshard_after_forward=accelerator.state.fsdp_plugin.reshard_after_forward)

def batch_norm_statistics_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """DeepSpeed's bf16/fp16 engines cast the parameters but not the buffers, and BatchNorm needs
    its running statistics in its weights' dtype."""
    for buffer in running_statistics(model):
        buffer.data = buffer.to(dtype)

def align_deepspeed_config(config: dict, max_grad_norm: float, per_device_batch: int) -> None:
    """- DeepSpeed clips at `--max_grad_norm` like the other strategies: accelerate fills an
      `"auto"` (or missing) `gradient_clipping` with 1.0, so we write our value in; a number
      in the JSON that disagrees with the flag is an error rather than a silent difference.
    - Its `"auto"` micro-batch is `--per_device_train_batch_size`: accelerate would take the
      smallest batch of all dataloaders passed to `prepare`, the eval one included."""
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = per_device_batch
    clipping = config.get("gradient_clipping", "auto")
    if clipping == "auto":
        config["gradient_clipping"] = max_grad_norm
    elif float(clipping) != max_grad_norm:
        raise StrategyError(
            f"gradient_clipping is {clipping} in the DeepSpeed JSON but --max_grad_norm is {max_grad_norm}; "
            'set "gradient_clipping": "auto" in the JSON so the flag decides'
        )

def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor | float:
    """Clip the global gradient norm to `max_norm`; return the norm before clipping, still on the device.

    DeepSpeed clips inside its own step (`gradient_clipping`, set from --max_grad_norm), and
    accelerate's `clip_grad_norm_` reads its norm with `.item()`, a wait for the GPU at every
    step: the engine's value is taken as it is instead."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        return model.get_global_grad_norm()
    if isinstance(model, ModelRunner):  # a part's model that clips itself (pipeline stages: the norm over every stage)
        return model.clip_grad_norm_(max_norm)
    return accelerator.clip_grad_norm_(model.parameters(), max_norm)

def held_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """Gradients a strategy keeps outside `param.grad`: DeepSpeed ZeRO's partitions (for measuring memory)."""
    if wrapped_strategy(model) is not Strategy.DEEPSPEED:
        return []
    zero = model.optimizer
    found = [getattr(zero, "grad_partitions_flat_buffer", None)]  # ZeRO-3: one flat buffer
    for grads in getattr(zero, "averaged_gradients", {}).values():  # ZeRO-1/2: per parameter group
        found += [getattr(grads, "flat_partition", None), *(grads or [])]
    return [tensor for tensor in found if isinstance(tensor, torch.Tensor)]

def write_effective_deepspeed_config(accelerator: Accelerator, output_dir: str) -> None:
    """Save the DeepSpeed config as resolved by `prepare` (no "auto"), for the record."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and accelerator.is_main_process:
        path = Path(output_dir) / "deepspeed_config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plugin.deepspeed_config, indent=2, default=str))


@contextmanager
def own_class_while_saving(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2 turns the model into an instance of a subclass it defines (`FSDP<Model>`, in torch's
    module). `save_pretrained` of a custom model names the instance's class in the export's
    `auto_map` and copies that class's file: the model's own class must be the one saved."""
    from torch.distributed.fsdp import FSDPModule

    fsdp_class = type(model)
    if FSDPModule not in fsdp_class.__bases__:
        yield
        return
    model.__class__ = next(base for base in fsdp_class.__bases__ if base is not FSDPModule)
    try:
        yield
    finally:
        model.__class__ = fsdp_class
