"""LoRA (and DoRA) adapters through `peft` (`--use_peft`, TRL's `ModelConfig` flag names): the base model
frozen, an adapter added after the seed (every rank draws the same one), the adapter exported (peft's format)
and, with `--merge_adapter`, merged into a plain model. `adapters.py` holds the peft side. docs/sft.md.

    accelerate launch train.py --task sft --model_name_or_path DIR --use_peft --lora_r 16
"""

import logging
import os
import warnings
from dataclasses import dataclass, field, fields

from training.errors import ArgumentError
from training.parts import Finished, Flags, Part


@dataclass
class LoraFlags:
    use_peft: bool = field(default=False, metadata={
        "help": "Train a LoRA adapter (peft) on the frozen --model_name_or_path instead of every weight."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling: the update is multiplied by alpha / r."})
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "Dropout on the adapter's input. Default 0: with dropout, runs split differently over "
                          "processes draw different masks, and agree in distribution only."},
    )
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Module names that get an adapter (e.g. q_proj v_proj), or all-linear (all but the output layer)."},
    )
    lora_modules_to_save: list[str] | None = field(default=None, metadata={
        "help": "Modules trained whole and saved with the adapter (e.g. lm_head)."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA: weight-decomposed LoRA."})
    merge_adapter: bool = field(default=False, metadata={
        "help": "Also write final/merged: the base model with the adapter merged in, plain transformers."})


FLAGS = tuple(f.name for f in fields(LoraFlags))  # --use_peft first


class Lora(Part):
    name = "lora"
    description = "LoRA and DoRA adapters through peft, exported alone or merged (--use_peft)"
    flags = LoraFlags
    task_flags = {"causal-lm": FLAGS, "sft": FLAGS, "dpo": FLAGS}  # the models peft adapts here (CAUSAL_LM)
    files = ("tests/test_fine_tuning.py",)
    requirements = ("peft",)

    def check_flags(self, flags: Flags) -> None:
        """LoRA adapts a pretrained language model, in one process per device group; its flags need --use_peft."""
        from training.arguments import flags_given, split_model  # not at import: training/flags.py imports the parts

        model_args = flags.model
        if not model_args.parts.lora.use_peft:
            if given := flags_given(model_args, FLAGS[1:]):  # the adapter's settings
                raise ArgumentError(f"--{given[0]} is for adapters: add --use_peft, or drop it")
            return
        if not model_args.model_name_or_path:
            raise ArgumentError("--use_peft trains an adapter on a pretrained model's frozen weights: give "
                                "--model_name_or_path (a Hub id or a directory), or drop --use_peft to train every weight")
        if split := split_model(flags):
            raise ArgumentError(f"--use_peft with {split} is not supported; train the adapter with a data-parallel "
                                "config instead (ddp.yaml, fsdp.yaml or a ZeRO config)")
        if model_args.parts.lora.lora_r < 1 or model_args.parts.lora.lora_alpha <= 0 or not 0 <= model_args.parts.lora.lora_dropout < 1:
            raise ArgumentError(f"--lora_r must be >= 1, --lora_alpha > 0 and --lora_dropout in [0, 1); got "
                                f"{model_args.parts.lora.lora_r}, {model_args.parts.lora.lora_alpha}, {model_args.parts.lora.lora_dropout}")

    def adapt_model(self, model, flags: Flags):
        """The model frozen with a fresh adapter under --use_peft (after the seed: every rank draws the same)."""
        if not flags.model.parts.lora.use_peft:
            return model
        from parts.lora.adapters import add_adapter, trainable_summary

        # peft 0.21 reads transformers 5.23's deprecated `is_gradient_checkpointing` as it wraps a model (3 per run)
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = add_adapter(model, flags.model)
        if os.environ.get("RANK", "0") == "0":  # the main process (the dry run has no Accelerator to ask)
            logging.getLogger(__name__).info(trainable_summary(model))
        return model

    def run_ended(self, finished: Finished) -> None:
        """--merge_adapter: from the files just written, with plain peft (what a user would load), final/merged."""
        model_args = finished.model_args
        if finished.final_dir and model_args.parts.lora.use_peft and model_args.parts.lora.merge_adapter:
            from parts.lora.adapters import merge_adapter

            merged = merge_adapter(model_args.model_name_or_path, finished.final_dir, model_args.trust_remote_code)
            finished.processor.save_pretrained(merged)


PART = Lora()
