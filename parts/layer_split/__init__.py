"""Layer split (`--device_map`): one process spreads its model's layers over the GPUs it owns, with single.yaml
(parts/layer_split/split.py: accelerate's placement and its refusals). See docs/layer_split.md.
"""

from dataclasses import dataclass, field

from training.errors import ArgumentError
from training.parts import Flags, Part, Started

DEVICE_MAPS = ["auto", "balanced", "balanced_low_0", "sequential"]  # "auto" is "balanced", as in transformers


@dataclass
class LayerSplitFlags:
    device_map: str | None = field(
        default=None,
        metadata={"help": "Split the layers over this process's GPUs (single.yaml; see parts/layer_split).",
                  "choices": DEVICE_MAPS},
    )


class LayerSplit(Part):
    name = "layer_split"
    description = "one process's model split layer-wise over its GPUs (--device_map)"
    flags = LayerSplitFlags

    def check_flags(self, flags: Flags) -> None:
        """One process owns the GPUs it splits the model over: the launch is single.yaml's."""
        from training.strategy import Strategy, requested_strategy

        if flags.train.parts.layer_split.device_map and requested_strategy() is not Strategy.SINGLE:
            raise ArgumentError(
                f"--device_map splits one model over the GPUs of one process, but the launch asked for "
                f"{requested_strategy().value}; use --config_file accelerate_configs/single.yaml (or FSDP2/ZeRO-3 to "
                "shard)"
            )

    def model_split(self, flags: Flags) -> str | None:
        return "--device_map" if flags.train.parts.layer_split.device_map else None

    def wrap_model(self, model, run: Started):
        """The model's layers placed over this process's GPUs, under --device_map."""
        if not run.args.parts.layer_split.device_map:
            return model
        from accelerate.logging import get_logger

        from parts.layer_split.split import split_layers

        model, note = split_layers(model, run.args.parts.layer_split.device_map)
        get_logger(__name__).info(note, main_process_only=True)
        return model


PART = LayerSplit()
