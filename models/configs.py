"""Named Llama-style configs for `--model_config NAME` (a part adds its own: parts/images/configs.py). Config
classes are imported only when a config is made: `train.py --help` lists the names without loading torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerBase


def _llama(hidden: int, layers: int, heads: int, intermediate: int, positions: int) -> Callable[[int, int], LlamaConfig]:
    def make(vocab_size: int, eos_token_id: int) -> LlamaConfig:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, intermediate_size=intermediate, max_position_embeddings=positions,
            bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id, tie_word_embeddings=False)

    return make


NAMED_CONFIGS: dict[str, Callable[[int, int], PretrainedConfig]] = {
    "llama-tiny": _llama(hidden=64, layers=2, heads=4, intermediate=176, positions=128),  # tests: seconds
    "llama-small": _llama(hidden=256, layers=4, heads=4, intermediate=688, positions=256),  # the default job
    # GPU benchmarks: GPT-2-small's body (~86M parameters with the shipped tokenizer, ~125M with a 50k vocabulary)
    "llama-125m": _llama(hidden=768, layers=12, heads=12, intermediate=2048, positions=1024),
}


def build_named_config(name: str, tokenizer: PreTrainedTokenizerBase, overrides: str | None = None) -> PretrainedConfig:
    """The config `name`, its vocabulary fitting `tokenizer`, then `overrides` (--config_overrides: "key=value,...")."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown --model_config {name!r}; choose one of {sorted(NAMED_CONFIGS)}")
    vocab_size = -(-len(tokenizer) // 64) * 64  # a multiple of 64 keeps the output matmul fast
    config = NAMED_CONFIGS[name](vocab_size, tokenizer.eos_token_id)
    if overrides:
        try:
            config.update_from_string(overrides)
        except ValueError as error:
            raise ValueError(f"--config_overrides {overrides!r}: {error}") from None
    return config
