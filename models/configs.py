"""Named Llama-style configs for `--model_config NAME` (a part adds its own: parts/images/configs.py). Config
classes are imported only when a config is made: `train.py --help` lists the names without loading torch."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerBase


def llama_mlp_width(hidden: int) -> int:
    """Llama's MLP width: 8/3 of the hidden size, rounded up to a multiple of 16."""
    return -(-8 * hidden // (3 * 16)) * 16


def _llama(hidden: int, layers: int, heads: int, positions: int) -> Callable[[int, int], LlamaConfig]:
    def make(vocab_size: int, eos_token_id: int) -> LlamaConfig:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, intermediate_size=llama_mlp_width(hidden), max_position_embeddings=positions,
            bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id, tie_word_embeddings=False)

    return make


NAMED_CONFIGS: dict[str, Callable[[int, int], PretrainedConfig]] = {
    "llama-tiny": _llama(hidden=64, layers=2, heads=4, positions=128),  # tests: seconds
    "llama-small": _llama(hidden=256, layers=4, heads=4, positions=256),  # the default job
    # GPU benchmarks: GPT-2-small's body (~86M parameters with the shipped tokenizer, ~125M with a 50k vocabulary)
    "llama-125m": _llama(hidden=768, layers=12, heads=12, positions=1024),
}
# What a config derives from its hidden size (and heads), recomputed when --config_overrides changes those alone
DERIVED = {"head_dim": (("hidden_size", "num_attention_heads"), lambda c: c.hidden_size // c.num_attention_heads),
           "intermediate_size": (("hidden_size",), lambda c: llama_mlp_width(c.hidden_size))}


def build_named_config(name: str, tokenizer: PreTrainedTokenizerBase, overrides: str | None = None) -> PretrainedConfig:
    """The config `name`, its vocabulary fitting `tokenizer`, then `overrides` (--config_overrides: "key=value,...").
    What the config derived from a size the overrides change (the heads' width, the MLP's) is derived again, unless
    they set it too; a head width that does not fill the hidden size is refused."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown --model_config {name!r}; choose one of {sorted(NAMED_CONFIGS)}")
    vocab_size = -(-len(tokenizer) // 64) * 64  # a multiple of 64 keeps the output matmul fast
    config = NAMED_CONFIGS[name](vocab_size, tokenizer.eos_token_id)
    if not overrides:
        return config
    derived = [key for key, (sources, rule) in DERIVED.items() if getattr(config, key, None) == rule(config)]
    items = [item for item in overrides.split(",") if item.strip()]
    nested = [item for item in items if "." in item.split("=", 1)[0]]
    try:
        if plain := [item for item in items if item not in nested]:
            config.update_from_string(",".join(plain))
        for item in nested:  # an entry of a dict field: rope_parameters.rope_theta=500000
            if "=" not in item:
                raise ValueError(f"{item.strip()} has no value; give it as key=value")
            set_nested(config, *item.split("=", 1))
    except ValueError as error:
        hint = "; RoPE's settings are fields of rope_parameters, e.g. rope_parameters.rope_theta=500000" if \
            "rope_" in str(error) else ""
        raise ValueError(f"--config_overrides {overrides!r}: {error}{hint}") from None
    given = overridden(overrides)
    for key in derived:
        sources, rule = DERIVED[key]
        if key not in given and given & set(sources):
            setattr(config, key, rule(config))
    heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
    if "head_dim" in given and heads and head_dim * heads != config.hidden_size:
        raise ValueError(f"--config_overrides {overrides!r}: {heads} heads of head_dim {head_dim} are "
                         f"{heads * head_dim} wide, and hidden_size is {config.hidden_size}; drop head_dim (it then "
                         "follows hidden_size / num_attention_heads) or make them agree")
    return config


def set_nested(config: PretrainedConfig, key: str, value: str) -> None:
    """`field.entry=value` of --config_overrides: one entry of a dict field set or added (rope_parameters.factor=4.0),
    its value typed as the entry it replaces, else read as a number, true/false or text."""
    field, entry = key.strip().split(".", 1)
    held = getattr(config, field, None)
    if not isinstance(held, dict):
        raise ValueError(f"key {key.strip()} isn't in the original config dict ({field} is not a dict field)")
    old, text = held.get(entry), value.strip()
    if isinstance(old, bool) or (old is None and text.lower() in ("true", "false")):
        parsed = text.lower() in ("true", "1", "y", "yes")
    else:
        parsed = text
        for kind in (type(old),) if isinstance(old, int | float) else (int, float):
            with contextlib.suppress(ValueError):
                parsed = kind(text)
                break
        if isinstance(old, int | float) and not isinstance(parsed, type(old)):
            raise ValueError(f"{key.strip()}={value}: {entry} is a {type(old).__name__}")
    setattr(config, field, {**held, entry: parsed})


def overridden(overrides: str | None) -> set[str]:
    """The keys --config_overrides sets (a dict field's entry, `rope_parameters.rope_theta`, by its field)."""
    return {item.split("=", 1)[0].strip().split(".")[0] for item in (overrides or "").split(",") if "=" in item}


def describe_shape(config: PretrainedConfig, overrides: str | None = None) -> str:
    """A decoder's shape in one phrase (hidden size, layers, heads and their width, MLP, vocabulary: those its config
    names), saying which sizes --config_overrides made the config derive again."""
    given = overridden(overrides)
    size = lambda key: getattr(config, key, None)  # noqa: E731
    heads = size("num_attention_heads")
    width = size("head_dim") or (size("hidden_size") // heads if heads and size("hidden_size") else None)
    phrases = {"hidden_size": f"hidden {size('hidden_size')}", "num_hidden_layers": f"{size('num_hidden_layers')} layers",
               "head_dim": f"{heads} heads of {width}", "intermediate_size": f"MLP {size('intermediate_size')}",
               "vocab_size": f"vocabulary {size('vocab_size')}"}
    shown = {"head_dim": heads and width}
    again = {key for key, (sources, _) in DERIVED.items() if key not in given and given & set(sources)}
    return ", ".join(phrase + (" (derived again)" if key in again else "") for key, phrase in phrases.items()
                     if shown.get(key, size(key)))
