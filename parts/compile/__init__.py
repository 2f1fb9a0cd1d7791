"""torch.compile (`--torch_compile` and its options, transformers' names): the model compiled through accelerate's
dynamo plugin, and the training step's model and loss as one graph (graph.py). See docs/compile.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from training.parts import Flags, Launch, Part, Training

COMPILE_MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]  # torch.compile(mode=...)


@dataclass
class CompileFlags:
    torch_compile: bool = field(default=False, metadata={
        "help": "Compile with torch.compile (inductor): the model and its loss as one graph (parts/compile)."})
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
    after = ("bf16_params", "distillation")  # it compiles the objective they made

    def check_flags(self, flags: Flags) -> None:
        """--torch_compile_mode implies --torch_compile (as in transformers); the other options need it."""
        from training.errors import ArgumentError

        own = flags.train.parts.compile
        own.torch_compile = own.torch_compile or own.torch_compile_mode is not None
        options = {"torch_compile_fullgraph": False, "torch_compile_dynamic": None, "torch_compile_regional": False}
        if not own.torch_compile and (given := [name for name, off in options.items() if getattr(own, name) != off]):
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
        """The training step's model forward and loss as one compiled graph (unless compilation is regional)."""
        from parts.compile.graph import compiled_objective

        return compiled_objective(objective, training.args)


PART = Compile()
