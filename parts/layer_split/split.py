"""Owns `--device_map`'s placement: one process splits the model's layers over the GPUs it owns (pipeline-free
model parallelism).

The first layers sit on GPU 0, the next on GPU 1, and so on; accelerate's hooks move the
activations from one GPU to the next, and the outputs back to GPU 0. It trains a model too
big for one GPU on one machine without any distributed setup, but only one GPU computes at
a time (the others wait for their layers' turn), so it is no faster than one GPU. With
several machines, or when speed matters, shard instead (FSDP2, ZeRO-3).

Launch it with `accelerate_configs/single.yaml`: the strategies that start one process per
GPU cannot also split each model over the GPUs (accelerate refuses).
"""

from __future__ import annotations

from collections import Counter

import torch
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import get_balanced_memory

from training.errors import StrategyError


def split_layers(
    model: torch.nn.Module, device_map: str, max_memory: dict[int | str, int] | None = None
) -> tuple[torch.nn.Module, str]:
    """Place the model's layers over the visible GPUs; the model and a line for the logs.

    "balanced" spreads the layers evenly, "balanced_low_0" leaves GPU 0 room for the
    outputs and loss, "sequential" fills GPU 0 first (counting parameters only: training
    also needs room for gradients, optimizer state and activations). `max_memory` caps the
    bytes per device, as in accelerate.
    """
    no_split = list(getattr(model, "_no_split_modules", None) or [])  # a decoder layer stays on one device
    if device_map != "sequential" and max_memory is None:
        max_memory = get_balanced_memory(model, no_split_module_classes=no_split, low_zero=device_map == "balanced_low_0")
    placement = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    devices = Counter(str(device) for device in placement.values())
    gpus = [device for device in devices if device not in ("cpu", "disk")]
    offloaded = {device: count for device, count in devices.items() if device == "disk" or (gpus and device == "cpu")}
    if offloaded:
        raise StrategyError(
            f"--device_map {device_map}: the model does not fit on the GPUs and {offloaded} modules would be offloaded, "
            "where they do not train; use more GPUs, --gradient_checkpointing, or deepspeed_zero3_offload.yaml"
        )
    if len(devices) == 1:  # nothing to split: accelerate places the model as usual
        return model, f"--device_map {device_map}: the whole model fits on {next(iter(devices))}; nothing to split"
    model = dispatch_model(model, placement)
    spread = ", ".join(f"{count} on {'cuda:' if device.isdigit() else ''}{device}" for device, count in devices.items())
    return model, f"--device_map {device_map}: layers split over {len(devices)} GPUs ({spread}); one computes at a time"
