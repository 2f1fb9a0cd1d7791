"""Liger's Triton kernels (`--use_liger_kernel`): fused RMSNorm, SwiGLU and RoPE for Llama-family models on
NVIDIA GPUs, an optional install (`pip install liger-kernel==0.8.5`), refused in one line elsewhere.

Without torch.compile, elementwise steps are most of a small model's GPU time; with it, inductor fuses
them itself and cannot fuse across Liger's kernels. Measured on an H200 (docs/gpus.md, "MFU at a 50k
vocabulary"; docs/liger.md): eager steps 9% faster, compiled ones 12% slower. So the flag is for eager runs.
"""

from dataclasses import dataclass, field

from training.parts import Part, Started


@dataclass
class LigerFlags:
    use_liger_kernel: bool = field(default=False, metadata={
        "help": "Liger's Triton kernels for the model's RMSNorm, SwiGLU and RoPE (Llama-family models on NVIDIA GPUs; "
                "pip install liger-kernel). transformers' name."})


class Liger(Part):
    name = "liger"
    description = "Liger's fused RMSNorm, SwiGLU and RoPE kernels on NVIDIA GPUs (--use_liger_kernel)"
    flags = LigerFlags

    def convert_model(self, model, run: Started):
        """The model with Liger's kernels in its modules, under --use_liger_kernel."""
        if run.args.parts.liger.use_liger_kernel:
            from parts.liger.kernels import apply_liger_kernel

            apply_liger_kernel(model, run.accelerator.device)
        return model


PART = Liger()
