"""GPU defaults that a run would otherwise leave slow: TF32 for fp32 matmuls (`--tf32`), DataLoader workers, and a
warning when a launch leaves GPUs idle (settings.py). No effect on CPU. See docs/cuda_settings.md."""

import os
from dataclasses import dataclass, field

from training.parts import Part


@dataclass
class CudaFlags:
    tf32: bool | None = field(default=None, metadata={
        "help": "TF32 tensor cores for fp32 matmuls and convolutions (Ampere and newer GPUs). Default: on "
                "when training on GPUs without --mixed_precision bf16/fp16; no effect on CPU."})


def started(accelerator, args) -> str | None:
    """TF32 on or off, applied to torch's settings (MFU then counts against the TF32 peak)."""
    if accelerator.device.type != "cuda":
        return None
    from parts.cuda_settings.settings import use_tf32

    enabled = use_tf32(args.tf32, accelerator.device, accelerator.mixed_precision)
    return f"tf32={'on' if enabled else 'off'} (fp32 matmuls and convolutions; --tf32)"


def loader_settings(args) -> dict:
    """Without --dataloader_num_workers: up to 4 loader workers per process on GPUs."""
    if args.dataloader_num_workers is not None:
        return {}
    from accelerate import PartialState

    from parts.cuda_settings.settings import loader_workers

    return {"num_workers": loader_workers(None, PartialState().device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))}


def after_prepare(accelerator, model, optimizer, args) -> None:
    """A warning when this machine has more GPUs than processes (one process holding layers on several owns them)."""
    from accelerate.logging import get_logger

    from parts.cuda_settings.settings import idle_gpu_warning

    devices = {p.device for p in model.parameters() if p.device.type == "cuda"}
    if warning := idle_gpu_warning(accelerator, owns_every_gpu=len(devices) > 1):
        get_logger(__name__).warning(warning, main_process_only=True)


PART = Part("cuda_settings", "GPU defaults: TF32 for fp32 runs (--tf32), loader workers, idle GPUs named", CudaFlags,
            started=started, loader_settings=loader_settings, after_prepare=after_prepare)
