"""The output layer as the loss (parts/fused_loss): while a training step's targets are set, the model's output layer
returns the sum of cross-entropy over them, computed from the last hidden states in chunks, in place of the logits.
It runs inside the model's forward, where FSDP2 and ZeRO-3 have gathered the layer's weight; evaluation and
generation, which set no targets, get the logits."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from training.errors import ArgumentError
from training.loss import next_token_targets

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
# Rows of hidden states per chunk. On CPU (4,096 tokens, d = 768, 50,304 classes, fp32, one thread) forward and
# backward took 11.1 s at 1,024 rows against 12.1 s for the whole logits and 16.0 s at torch's own pick (64 rows).
CHUNK_ROWS = 1024


def torch_kernel(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 targets: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of cross-entropy over `targets` by torch's chunked `F.linear_cross_entropy` (torch 2.13)."""
    options = torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=CHUNK_ROWS)
    if hidden.dtype == torch.float32:
        return F.linear_cross_entropy(hidden, weight, targets, linear_bias=bias, reduction="sum", options=options)
    # In bf16 torch adds the chunks' sums in bf16 (7% low over 128 chunks of 32 tokens; 0.2% high over 4 chunks of
    # 1,024): the tokens' losses, added here in fp32.
    losses = F.linear_cross_entropy(hidden, weight, targets, linear_bias=bias, reduction="none", options=options)
    return losses.float().sum()


def liger_kernel(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 targets: torch.Tensor) -> torch.Tensor:
    """The same sum by Liger's fused Triton kernel (NVIDIA GPUs, --use_liger_kernel); the weight's gradient is
    accumulated over chunks in fp32, then cast to the weight's dtype (as the logits' matmul gives it)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="sum", accum_dtype=torch.float32)


class LossHead:
    """`layer` (a model's `nn.Linear` output layer) computing `kernel`'s loss while `loss_sums` runs the model."""

    def __init__(self, layer: torch.nn.Linear, kernel: Kernel) -> None:
        self.layer, self.kernel = layer, kernel
        self.targets: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.checked = False  # what the model returns for the layer's loss: compared once
        self.logits = layer.forward
        layer.forward = self.forward  # the module's own call stays: the hooks of FSDP2 and ZeRO-3 on it still run

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return self.logits(hidden)
        if hidden.shape[:-1] != self.targets.shape:
            raise ArgumentError(f"--fused_linear_cross_entropy: the output layer got hidden states of shape "
                                f"{tuple(hidden.shape)} for targets of shape {tuple(self.targets.shape)}: drop the flag")
        device = hidden.device.type
        # the matmul's dtype under autocast is autocast's, as the logits' would be; the kernel then runs as it is
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        bias = None if self.layer.bias is None else self.layer.bias.to(dtype)
        with torch.autocast(device, enabled=False):
            self.loss = self.kernel(hidden.flatten(0, -2).to(dtype), self.layer.weight.to(dtype), bias,
                                    self.targets.flatten())
        return self.loss

    def loss_sums(self, task, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The micro-batch's sum of next-token cross-entropy (`task.forward` run with the targets set)."""
        self.targets = next_token_targets(batch["labels"])
        try:
            returned = task.forward(model, batch)
        finally:
            self.targets = None
        loss, self.loss = self.loss, None
        if loss is None:
            raise ArgumentError("--fused_linear_cross_entropy: the model's forward does not call its output layer "
                                "(get_output_embeddings()) as a module: drop the flag")
        # A model fixes what follows its output layer: checked once (a comparison waits for the device). Strategies
        # may wrap the sum on its way out: ZeRO-3 hooks its backward there, FSDP2's bf16 policy casts it to bf16
        # (rounding it by up to 2**-9), so the value is the layer's and the gradient goes through what was returned.
        # A NaN passed through unchanged is the non-finite guard's to report, not a change of the layer's result.
        if not self.checked and not (returned.shape == loss.shape and
                                     torch.allclose(returned.float(), loss, rtol=2**-7, atol=0, equal_nan=True)):
            raise ArgumentError("--fused_linear_cross_entropy: the model changes what its output layer returns (a "
                                "scaling or a softcap of the logits), so its loss cannot be computed there: drop the flag")
        self.checked = True
        return loss.detach() + (returned.float() - returned.float().detach())
