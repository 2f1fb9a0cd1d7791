"""What each strategy needs before `prepare` to train what train.py asks for (`align_with_strategy`), and the few
reads that differ per wrapper (the bare model, the DeepSpeed config written, FSDP2's class while saving)."""

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
from training.strategy.shares import keep_frozen_values
from training.errors import StrategyError
from training.performance import compute_dtype
from training.strategy import Strategy, wrapped_strategy


def optimizer_offload_device(accelerator: Accelerator) -> str:
    """Where ZeRO keeps and steps the optimizer: "cpu" or "nvme" under offload, else "none"."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return "none"
    return plugin.deepspeed_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")


def config_name(accelerator: Accelerator, strategy: Strategy) -> str:
    """The strategy as its config file is named (ddp, fsdp, deepspeed_zero3_offload): what a checkpoint records."""
    if strategy is not Strategy.DEEPSPEED:
        return strategy.value
    offload = "_offload" if optimizer_offload_device(accelerator) != "none" else ""
    return f"deepspeed_zero{accelerator.state.deepspeed_plugin.zero_stage}{offload}"


def align_with_strategy(accelerator: Accelerator, model: torch.nn.Module, max_grad_norm: float, per_device_batch: int) -> None:
    """Before the optimizer and `prepare`: make the strategy run what train.py asks for."""
    half = compute_dtype(accelerator.mixed_precision)
    if accelerator.distributed_type is DistributedType.FSDP:
        answer_none_for_missing_embeddings(model)
        if accelerator.state.fsdp_plugin.cpu_ram_efficient_loading and (buffers := persistent_buffers(model)):
            raise StrategyError(
                f"fsdp_cpu_ram_efficient_loading broadcasts only parameters from rank 0, and this model has buffers "
                f"that are saved with it ({', '.join(buffers[:3])}...); set `fsdp_cpu_ram_efficient_loading: false` "
                "in the accelerate config (every rank then builds the whole model)")
        if half is not torch.float32:
            keep_batch_norm_in_fp32(model, accelerator)
            _reduce_gradients_in_fp32(accelerator)
    if accelerator.state.deepspeed_plugin is not None:
        align_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, max_grad_norm, per_device_batch)
        if half is not torch.float32:
            batch_norm_statistics_in(model, half)
            keep_frozen_values(model, accelerator.process_index, accelerator.num_processes)


def persistent_buffers(model: torch.nn.Module) -> list[str]:
    """Names of the buffers in the model's state dict (BatchNorm statistics; not rotary tables)."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in model.state_dict() if name not in parameters]


def answer_none_for_missing_embeddings(model: torch.nn.Module) -> None:
    """accelerate 1.15's FSDP2 expects None from models without input embeddings; `transformers` raises instead."""
    try:
        model.get_input_embeddings()
    except (NotImplementedError, AttributeError):  # (a plain nn.Module has no such method: accelerate then skips it)
        model.get_input_embeddings = lambda: None


def _reduce_gradients_in_fp32(accelerator: Accelerator) -> None:
    """accelerate's FSDP2 bf16/fp16 policy reduces gradients in 8 mantissa bits: use fp32, as torchtitan and DDP do."""
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version == 2 and plugin.mixed_precision_policy is not None:
        plugin.mixed_precision_policy = dataclasses.replace(plugin.mixed_precision_policy, reduce_dtype=torch.float32)


def gradient_reduction_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The dtypes the ranks average gradients in (DeepSpeed's default under bf16: bf16)."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        return {model.communication_data_type}
    states = [module._get_fsdp_state() for module in model.modules() if hasattr(module, "_get_fsdp_state")]
    if states:  # no reduce_dtype: the param_dtype, else the (fp32) parameters'
        return {state._mp_policy.reduce_dtype or state._mp_policy.param_dtype or torch.float32 for state in states}
    return {param.dtype for param in model.parameters() if param.requires_grad}


def keep_batch_norm_in_fp32(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """FSDP2 casts BatchNorm weights to bf16, not running stats, which BatchNorm refuses (pytorch/torchtitan#674).
    Its output goes on in the compute dtype: the layer after it may be in no unit of its own that casts its input."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                output_dtype=compute_dtype(accelerator.mixed_precision))
    for layer in batch_norm_layers(model):
        fully_shard(layer, mp_policy=fp32, reshard_after_forward=accelerator.state.fsdp_plugin.reshard_after_forward)


def batch_norm_statistics_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """DeepSpeed's half-precision engines cast parameters, not buffers; BatchNorm needs both in one dtype."""
    for buffer in running_statistics(model):
        buffer.data = buffer.to(dtype)


def align_deepspeed_config(config: dict, max_grad_norm: float, per_device_batch: int) -> None:
    """Fill DeepSpeed's "auto"s from our flags: accelerate would clip at 1.0 and take the smallest (eval's) batch."""
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = per_device_batch
    clipping = config.get("gradient_clipping", "auto")
    if clipping == "auto":
        config["gradient_clipping"] = max_grad_norm
    elif float(clipping) != max_grad_norm:
        raise StrategyError(
            f"gradient_clipping is {clipping} in the DeepSpeed JSON but --max_grad_norm is {max_grad_norm}; "
            'set "gradient_clipping": "auto" in the JSON so the flag decides')


def write_effective_deepspeed_config(accelerator: Accelerator, output_dir: str) -> None:
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and accelerator.is_main_process:
        path = Path(output_dir) / "deepspeed_config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plugin.deepspeed_config, indent=2, default=str))


@contextmanager
def own_class_while_saving(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2 makes the model an `FSDP<Model>`: a custom model's `save_pretrained` would copy that into `auto_map`."""
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
