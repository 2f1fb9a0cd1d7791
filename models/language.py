"""Causal language models and their tokenizer: a Hub id or local directory (--model_name_or_path), or a named config
from models/configs.py trained from scratch with the tokenizer shipped in models/tokenizer/ (the default job)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.initialization import no_init_weights

from models.configs import build_named_config
from training.errors import ModelError

SHIPPED_TOKENIZER = Path(__file__).resolve().parent / "tokenizer"


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@contextmanager
def loading(what: str, source: str) -> Iterator[None]:
    """Turn `transformers` loading failures into one `ModelError` line."""
    try:
        yield
    except (OSError, ValueError) as error:
        if "trust_remote_code" in str(error):
            raise ModelError(f"{what} {source} needs its own Python code to load; pass --trust_remote_code "
                             "only if you trust that code (it runs on every rank)") from None
        raise ModelError(f"cannot load {what} {source}: {first_line(error)}") from None


def build_tokenizer(model_name_or_path: str | None, tokenizer_name: str | None,
                    trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer named explicitly, else the pretrained model's own, else the shipped one."""
    source = tokenizer_name or model_name_or_path or str(SHIPPED_TOKENIZER)
    with loading("tokenizer", source):
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(model_name_or_path: str | None, model_config: str, tokenizer: PreTrainedTokenizerBase,
                trust_remote_code: bool = False, gradient_checkpointing: bool = False, empty: bool = False,
                config_overrides: str | None = None) -> PreTrainedModel:
    """Pretrained weights, or a named config from scratch (seed first); fp32 always: the strategy keeps fp32 master
    weights. `empty`: the architecture only, its weights to come from another rank (`model_construction`)."""
    if model_name_or_path and not empty:
        with loading("model", model_name_or_path):
            model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=torch.float32,
                                                         trust_remote_code=trust_remote_code)
    else:
        if model_name_or_path:
            with loading("model", model_name_or_path):
                config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
        else:
            try:
                config = build_named_config(model_config, tokenizer, config_overrides)
            except ValueError as error:
                raise ModelError(str(error)) from None
        # Allocated, never written: no resident memory until the broadcast fills them. (Not the meta device:
        # accelerate maps the optimizer's parameters to the sharded ones by their distinct addresses.)
        with no_init_weights() if empty else nullcontext():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
        if empty:
            model.tie_weights()  # transformers ties inside init_weights, which no_init_weights skips
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:  # token ids past the embedding would crash, or train on garbage rows
        raise ModelError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows; use the model's own "
            "tokenizer, or resize on purpose (model.resize_token_embeddings(len(tokenizer)), then save_pretrained)")
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    if not model.supports_gradient_checkpointing:
        raise ModelError(f"{type(model).__name__} does not support --gradient_checkpointing; drop the flag")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def resolve_block_size(requested: int | None, config: PretrainedConfig, flag: str = "--block_size") -> int:
    """The requested length (`flag`), or the model's maximum capped at 1024; never above the maximum."""
    model_max = getattr(config, "max_position_embeddings", None)
    if requested is None:
        return min(model_max or 1024, 1024)
    if model_max is not None and requested > model_max:
        raise ModelError(f"{flag} {requested} exceeds the model's maximum of {model_max} positions")
    return requested
