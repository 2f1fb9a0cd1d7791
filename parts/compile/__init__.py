"""torch.compile (`--torch_compile` and its options, transformers' names): the model compiled through accelerate's
dynamo plugin, and the training step's model and loss as one graph (graph.py). Unset, the training step compiles where
it pays back: a run of at least `auto.PAYS_BACK_AFTER_STEPS` on the plain path (auto.py). See docs/compile.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from training.parts import Flags, Launch, Part, Training

COMPILE_MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]  # torch.compile(mode=...)


@dataclass
class CompileFlags:
    torch_compile: bool | None = field(default=None, metadata={
        "nargs": "?", "const": True,  # a bare --torch_compile is true, as in transformers
        "help": "Compile with torch.compile (inductor): the model and its loss as one graph (parts/compile). Unset: "
                "the training step compiles in runs of at least 1,000 steps on one process or DDP (docs/compile.md)."})
    torch_compile_mode: str | None = field(default=None, metadata={
        "help": "torch.compile's mode; implies --torch_compile.", "choices": list(COMPILE_MODES)})
    torch_compile_fullgraph: bool = field(default=False, metadata={"help": "--torch_compile: a graph break is an error."})
    torch_compile_dynamic: bool | None = field(default=None, metadata={"help": "--torch_compile: dynamic shapes or not."})
    torch_compile_regional: bool = field(default=False, metadata={
        "help": "--torch_compile: one decoder block compiled, reused by every layer; the loss runs eagerly."})


class Compile(Part):
    name = "compile"
    description = "torch.compile: the model, and the training step's model and loss as one graph (--torch_compile)"
    flags = CompileFlags
    after = ("bf16_params", "distillation", "fused_loss")  # it compiles the objective they made (auto: sees it)
    compiled = False

    def check_flags(self, flags: Flags) -> None:
        """--torch_compile_mode implies --torch_compile (as in transformers); the other options need it."""
        from training.errors import ArgumentError

        own = flags.train.parts.compile
        if own.torch_compile_mode is not None:
            own.torch_compile = True
        options = {"torch_compile_fullgraph": False, "torch_compile_dynamic": None, "torch_compile_regional": False}
        if own.torch_compile is not True and (given := [name for name, off in options.items() if getattr(own, name) != off]):
            raise ArgumentError(f"--{given[0]} is an option of --torch_compile: add --torch_compile, or drop it")

    def check_launch(self, launch: Launch) -> None:
        """The launcher's own torch.compile would be replaced by --torch_compile's: refused."""
        from training.errors import StrategyError

        if (backend := os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper()) != "NO":
            raise StrategyError(
                f"the launcher asks for torch.compile with dynamo backend {backend.lower()}, which train.py would "
                "replace: it compiles with its own --torch_compile (inductor); drop --dynamo_backend (or dynamo_config "
                "in the yaml) and pass --torch_compile to train.py"
            )

    def accelerator_settings(self, args) -> dict:
        """accelerate's dynamo plugin, which compiles the prepared model (evaluation's too)."""
        from parts.compile.graph import dynamo_plugin

        return {"dynamo_plugin": dynamo_plugin(args)}

    def training_objective(self, objective, training: Training):
        """The training step's model forward and loss as one compiled graph (unless compilation is regional); unset,
        where it pays back (auto.py). The choice and its reason go to the start-up log and summary.json."""
        from accelerate.logging import get_logger

        from parts.compile.auto import compiles
        from parts.compile.graph import compiled_objective

        self.compiled, why = compiles(objective, training)
        get_logger(__name__).info(f"torch.compile: {'on' if self.compiled else 'off'} ({why})", main_process_only=True)
        return compiled_objective(objective, training.args) if self.compiled else objective

    def summary(self, steps_run: int) -> dict:
        """Whether the training step ran compiled."""
        return {"torch_compile": self.compiled}


PART = Compile()
