"""GPU defaults that a run would otherwise leave slow: TF32 for fp32 matmuls (`--tf32`), DataLoader workers, and a
warning when a launch leaves GPUs idle (settings.py). No effect on CPU. See docs/cuda_settings.md."""

import os
from dataclasses import dataclass, field

from training.parts import Part, Started, Training


@dataclass
class CudaFlags:
    tf32: bool | None = field(default=None, metadata={
        "help": "TF32 tensor cores for fp32 matmuls and convolutions (Ampere and newer GPUs). Default: on "
                "when training on GPUs without --mixed_precision bf16/fp16; no effect on CPU."})


class CudaSettings(Part):
    name = "cuda_settings"
    description = "GPU defaults: TF32 for fp32 runs (--tf32), loader workers, idle GPUs named"
    flags = CudaFlags

    def started(self, run: Started) -> str | None:
        """TF32 on or off, applied to torch's settings (MFU then counts against the TF32 peak)."""
        if run.accelerator.device.type != "cuda":
            return None
        from parts.cuda_settings.settings import use_tf32

        enabled = use_tf32(run.args.parts.cuda_settings.tf32, run.accelerator.device, run.accelerator.mixed_precision)
        return f"tf32={'on' if enabled else 'off'} (fp32 matmuls and convolutions; --tf32)"

    def loader_settings(self, args) -> dict:
        """Without --dataloader_num_workers: up to 4 loader workers per process on GPUs."""
        if args.dataloader_num_workers is not None:
            return {}
        from accelerate import PartialState

        from parts.cuda_settings.settings import loader_workers

        return {"num_workers": loader_workers(None, PartialState().device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))}

    def after_prepare(self, training: Training) -> None:
        """A warning when this machine has more GPUs than processes (one process holding layers on several owns
        them)."""
        from accelerate.logging import get_logger

        from parts.cuda_settings.settings import idle_gpu_warning

        devices = {p.device for p in training.model.parameters() if p.device.type == "cuda"}
        if warning := idle_gpu_warning(training.accelerator, owns_every_gpu=len(devices) > 1):
            get_logger(__name__).warning(warning, main_process_only=True)


PART = CudaSettings()
