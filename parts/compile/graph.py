"""What torch.compile covers under --torch_compile and its options.

accelerate compiles the prepared model (`TorchDynamoPlugin`, built here from the flags), which
evaluation uses. Training compiles more: the micro-step's objective, the model's forward *and*
its loss, as one graph. Compiled alone, the model has to hand its logits out of the graph, and
under bf16 accelerate's output conversion writes them in fp32 (tokens x vocabulary x 4 bytes:
3.3 GB per 16k tokens at a 50k vocabulary), then the loss reads them again. Inside one graph
inductor fuses the upcast into the cross-entropy, and only per-sequence loss sums leave it.
(Regional compilation compiles the decoder blocks alone: the loss then runs eagerly. Distillation keeps
its own objective, uncompiled around the compiled student: the teacher may be a DeepSpeed engine.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate.utils import TorchDynamoPlugin


def dynamo_plugin(args) -> TorchDynamoPlugin:
    """accelerate's plugin for the model, from --torch_compile and its options (`args`: TrainArguments)."""
    if not args.parts.compile.torch_compile:
        return TorchDynamoPlugin(backend="no")
    return TorchDynamoPlugin(backend="inductor", **compile_options(args),
                             use_regional_compilation=args.parts.compile.torch_compile_regional)


def compile_options(args) -> dict:
    """torch.compile's keyword arguments that the flags set (unset ones keep torch's defaults)."""
    return {"mode": args.parts.compile.torch_compile_mode or "default", "fullgraph": args.parts.compile.torch_compile_fullgraph,
            "dynamic": args.parts.compile.torch_compile_dynamic}


def compiled_objective(objective: Callable[[torch.nn.Module, dict], torch.Tensor], args) -> Callable:
    """The training objective (model forward and per-example loss sums) as one compiled graph, unless compilation
    is regional (accelerate's plugin compiled the blocks): then `objective` unchanged."""
    if args.parts.compile.torch_compile_regional:
        return objective
    return torch.compile(objective, **compile_options(args))
