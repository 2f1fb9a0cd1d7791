"""MFU, model FLOPs utilisation: the training FLOP/s a run reaches (the task's FLOPs per token or image, times its
rate) over the devices' peak, in every logged interval and in summary.json (`mfu`, `steady_mfu`, with `peak_flops`
beside them so that a reader recomputes them). The peak comes from NVIDIA's datasheets, or a probe on CPU
(peaks.py). `python scripts/benchmark.py --mfu` measures it on the shape the field compares. See docs/mfu.md."""

from training.parts import Part, Training


class ModelFlopsUtilisation(Part):
    name = "mfu"
    description = "MFU (model FLOPs utilisation) in the logs and summary, from datasheet peaks or a CPU probe"
    files = ("scripts/mfu_benchmark.py",)

    def logged_figures(self, training: Training):
        """MFU for the task's model on this device; None (and a line saying why) when the peak or the FLOPs are
        unknown."""
        import torch
        from accelerate.logging import get_logger

        from parts.mfu.peaks import Mfu, device_peak_flops

        accelerator, task = training.accelerator, training.task
        peak = device_peak_flops(accelerator)  # a collective: every rank decides alike
        if peak and task.flops_per_unit:
            return Mfu(accelerator.device, task.flops_per_unit, peak, training.ranks_per_batch)
        device = accelerator.device
        here = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        unknown = ("the task's FLOPs per unit are unknown" if peak else
                   f"a rank's device has no known peak FLOP/s (this one: {here}; GPU_PEAK_FLOPS in parts/mfu/peaks.py)")
        get_logger(__name__).info(f"no MFU: {unknown}", main_process_only=True)
        return None


PART = ModelFlopsUtilisation()
