"""Layer-wise learning-rate decay (`--layer_lr_decay`) and the parameters that get no weight decay
(`--no_decay_names`), as timm's `param_groups_layer_decay` and BEiT/ELECTRA fine-tuning set them: the top layer
trains at --learning_rate, each block below at the factor times the one above, the embeddings lowest. One hook,
`optimizer_groups`: the core's two groups regrouped by depth, each with its rate, before the optimizer and the
schedule are built, so every strategy and --optim steps them and the schedule scales every group alike.
`depths.py` numbers the layers. docs/layer_lr.md.

    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml train.py --layer_lr_decay 0.8
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.errors import ArgumentError
from training.parts import Conflict, Flags, Grouping, Part


@dataclass
class LayerLrFlags:
    layer_lr_decay: float = field(default=1.0, metadata={
        "help": "Layer-wise learning-rate decay (timm's layer_decay): the top (what follows the last block: the final "
                "norm, the output head) trains at --learning_rate, each block below at this factor times the one "
                "above, the embeddings lowest; in (0, 1], 0.65 to 0.9 is common for fine-tuning. 1: off "
                "(docs/layer_lr.md)."})
    no_decay_names: str | None = field(default=None, metadata={
        "help": "Comma-separated fragments of parameter names that get no weight decay, in place of the default "
                "rule (biases and norm scales); add embed for the embeddings: bias,norm,embed."})


class LayerLr(Part):
    name = "layer_lr"
    description = "layer-wise learning-rate decay and the parameters without weight decay (--layer_lr_decay)"
    flags = LayerLrFlags
    # a pipeline's process holds some stages: it cannot number the whole model's layers
    conflicts = (Conflict("layer_lr_decay", "pipeline_parallel_size", ": a process holds some stages, not every "
                                                                      "layer to number"),)

    def check_flags(self, flags: Flags) -> None:
        own = flags.train.parts.layer_lr
        if not 0 < own.layer_lr_decay <= 1:
            raise ArgumentError(f"--layer_lr_decay {own.layer_lr_decay}: give a factor in (0, 1] (1: off)")
        if own.no_decay_names is not None and not own.no_decay_names.strip(", "):
            raise ArgumentError("--no_decay_names is empty: give name fragments (bias,norm), or drop it for the "
                                "default rule")

    def optimizer_groups(self, groups: list[dict], grouping: Grouping) -> list[dict]:
        """The groups by depth, top first (`lr` logs the top layer's rate), each at --learning_rate times the decay to
        the power of its distance from the top; weight decay as the core split it, or by --no_decay_names."""
        own = grouping.args.parts.layer_lr
        if (own.layer_lr_decay == 1 and own.no_decay_names is None) or not grouping.args.do_train:  # (nothing steps)
            return groups
        from parts.layer_lr.depths import regrouped

        return regrouped(groups, grouping.model, grouping.args, own.layer_lr_decay, own.no_decay_names)


PART = LayerLr()
