"""The peft side of the LoRA part: the flags become a `LoraConfig`, the base model is frozen, and the adapter
is what gets exported (and merged, on request).

Every strategy trains the same adapter: the frozen base weights are sharded or replicated
like any others, and only the adapter's parameters reach the optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from models.language import ModelError, first_line

if TYPE_CHECKING:  # peft is imported where it is used: it takes 1.7 s, which runs without adapters need not pay
    from peft import LoraConfig, PeftModel

    from parts.lora import LoraFlags
    from training.flags import ModelArguments

MERGED_DIR = "merged"  # under final/: the base model with the adapter merged in (--merge_adapter)


def lora_config(flags: LoraFlags) -> LoraConfig:
    """The `LoraConfig` the flags describe."""
    from peft import LoraConfig

    targets = flags.lora_target_modules
    return LoraConfig(
        r=flags.lora_r,
        lora_alpha=flags.lora_alpha,
        lora_dropout=flags.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        modules_to_save=flags.lora_modules_to_save,
        use_dora=flags.use_dora,
        task_type="CAUSAL_LM",
    )


def add_adapter(model: PreTrainedModel, model_args: ModelArguments) -> PeftModel:
    """`model` frozen, with a fresh adapter on the modules `--lora_target_modules` names."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(model_args.parts.lora))
    except ValueError as error:
        if "not found in the base model" in str(error) or "No modules were targeted" in str(error):
            raise ModelError(
                f"--lora_target_modules {' '.join(model_args.parts.lora.lora_target_modules)} matches no module of "
                f"{type(model).__name__}; its linear modules are: {' '.join(linear_module_names(model))} (or all-linear)"
            ) from None
        raise ModelError(f"peft cannot add this adapter to {type(model).__name__}: {first_line(error)}; "
                         "check the --lora_* flags") from None


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what --lora_target_modules matches)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)})


def trainable_summary(model: PeftModel) -> str:
    trainable, total = model.get_nb_trainable_parameters()
    return f"adapter: {trainable:,} trainable parameters of {total:,} ({trainable / total:.2%})"


def merge_adapter(base: str, adapter_dir: Path, trust_remote_code: bool = False) -> Path:
    """Load the base model and the saved adapter with plain peft, merge in fp32, and save a plain model
    in the base's own dtype in adapter_dir/merged (one process, CPU memory: the whole base model)."""
    from peft import PeftModel

    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, trust_remote_code=trust_remote_code)
        saved_dtype = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code).dtype or torch.float32
        merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
        merged.to(getattr(torch, saved_dtype) if isinstance(saved_dtype, str) else saved_dtype).save_pretrained(
            adapter_dir / MERGED_DIR)
    except (OSError, ValueError, RuntimeError) as error:  # the base gone, memory short, ...
        raise ModelError(f"--merge_adapter: merging {adapter_dir} into {base} failed ({first_line(error)}); the adapter is "
                         "saved: merge it later with PeftModel.from_pretrained(base, final).merge_and_unload()") from None
    return adapter_dir / MERGED_DIR
