"""LoRA (and DoRA) adapters through `peft`: the flags (TRL's `ModelConfig` names) become a
`LoraConfig`, the base model is frozen, and the adapter is what gets exported.

    accelerate launch train.py --task sft --model_name_or_path DIR --use_peft --lora_r 16

Every strategy trains the same adapter: the frozen base weights are sharded or replicated
like any others, and only the adapter's parameters reach the optimizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from models.language import ModelError

MERGED_DIR = "merged"  # under final/: the base model with the adapter merged in (--merge_adapter)


def lora_config(model_args) -> LoraConfig:
    """The `LoraConfig` the flags describe."""
    targets = model_args.lora_target_modules
    return LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        modules_to_save=model_args.lora_modules_to_save,
        use_dora=model_args.use_dora,
        task_type="CAUSAL_LM",
    )


def add_adapter(model: PreTrainedModel, model_args) -> PeftModel:
    """`model` frozen, with a fresh adapter on the modules `--lora_target_modules` names."""
    try:
        return get_peft_model(model, lora_config(model_args))
    except ValueError as error:
        if "not found in the base model" not in str(error) and "No modules were targeted" not in str(error):
            raise
        raise ModelError(
            f"--lora_target_modules {' '.join(model_args.lora_target_modules)} matches no module of "
            f"{type(model).__name__}; its linear modules are: {' '.join(linear_module_names(model))} (or all-linear)"
        ) from None


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what --lora_target_modules matches)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)})


def is_adapter(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)


def trainable_summary(model: PeftModel) -> str:
    trainable, total = model.get_nb_trainable_parameters()
    return f"adapter: {trainable:,} trainable parameters of {total:,} ({trainable / total:.2%})"


def merge_adapter(base: str, adapter_dir: Path, trust_remote_code: bool = False) -> Path:
    """Load the base model and the saved adapter with plain peft, merge, and save a plain model in
    adapter_dir/merged (one process, CPU: the base model fits in host memory whole here)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, trust_remote_code=trust_remote_code)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.save_pretrained(adapter_dir / MERGED_DIR)
    return adapter_dir / MERGED_DIR
