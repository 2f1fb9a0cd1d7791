"""bf16 parameters with fp32 master weights on ddp.yaml and one process (`--mixed_precision_param bfloat16`,
torchtitan's name): each micro-step's forward and backward run on bf16 copies of the parameters, cast inside the
autograd graph, so gradients reach the fp32 parameters in fp32 and the optimizer, clipping, DDP's all-reduce and
the checkpoints keep fp32. fsdp.yaml's FSDP2 policy and DeepSpeed's bf16 mode compute this way already; the
default, autocast over fp32 weights, keeps the residual stream and the norms in fp32. Evaluation keeps autocast.
Measured and tested: docs/bf16_params.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial

from training.parts import Conflict, Flags, Launch, Part, Started, Training


@dataclass
class Bf16ParamFlags:
    mixed_precision_param: str = field(default="float32", metadata={
        "help": "bfloat16: the training step computes on bf16 copies of the fp32 parameters (ddp.yaml, one "
                "process; needs --mixed_precision bf16), as fsdp.yaml and DeepSpeed's bf16 do. float32: autocast "
                "over the fp32 weights.", "choices": ["float32", "bfloat16"]})


class Bf16Params(Part):
    name = "bf16_params"
    description = "bf16 parameters with fp32 master weights on ddp.yaml and one process (--mixed_precision_param bfloat16)"
    flags = Bf16ParamFlags
    conflicts = tuple(Conflict("mixed_precision_param", other, ": drop one")
                      for other in ("gradient_checkpointing", "torch_compile", "teacher_model_name_or_path"))
    after = ("distillation", "fused_loss")  # a wrapper of the objective goes after a replacement

    def check_flags(self, flags: Flags) -> None:
        """Refused where the training step would not run the objective this part wraps, or where it is untested: a
        model split over stages, devices or tensor-parallel ranks, gradient checkpointing (its recomputed forward runs
        during the backward, on the fp32 parameters again), distillation (its own objective), and torch.compile."""
        from training.arguments import split_model
        from training.errors import ArgumentError

        if flags.train.parts.bf16_params.mixed_precision_param == "float32":
            return
        if split := split_model(flags):
            raise ArgumentError(f"--mixed_precision_param bfloat16 with {split} is not supported: drop one")

    def check_launch(self, launch: Launch) -> None:
        """Where the flag would change nothing: refused in one line."""
        from training.errors import StrategyError
        from training.strategy import Strategy

        if launch.args.parts.bf16_params.mixed_precision_param == "float32":
            return
        if launch.strategy not in (Strategy.SINGLE, Strategy.DDP):
            raise StrategyError(f"--mixed_precision_param bfloat16 is for ddp.yaml and one process: under "
                                f"{launch.strategy.value} --mixed_precision bf16 already computes on bf16 parameters; "
                                "drop the flag")
        if os.environ.get("ACCELERATE_MIXED_PRECISION", "no") != "bf16":
            raise StrategyError("--mixed_precision_param bfloat16 needs the launcher's --mixed_precision bf16: add it, "
                                "or drop the flag")

    def started(self, run: Started) -> str | None:
        """The start-up line that says the flag took effect."""
        if run.args.parts.bf16_params.mixed_precision_param == "bfloat16":
            return "--mixed_precision_param bfloat16: the training step computes on bf16 copies of the fp32 parameters"
        return None

    def training_objective(self, objective, training: Training):
        """The micro-step's loss sums computed on bf16 copies of the parameters, under --mixed_precision_param."""
        if training.args.parts.bf16_params.mixed_precision_param == "float32":
            return objective
        from parts.bf16_params.cast import on_bf16_copies
        from training.strategy import bare_model

        return on_bf16_copies(objective, partial(bare_model, training.accelerator))


PART = Bf16Params()
