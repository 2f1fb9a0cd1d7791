"""The model builder, the shipped tokenizer and the named configs."""

from __future__ import annotations

import pytest
import torch

from models.configs import NAMED_CONFIGS
from models.language import ModelError, build_model, build_tokenizer

pytestmark = pytest.mark.quick  # every test here: the quick tier (pytest -m quick)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(None, None)


@pytest.mark.parametrize("name", sorted(name for name in NAMED_CONFIGS if name.startswith("llama-")))
def test_named_configs_build_fp32_llama_models(name, tokenizer) -> None:
    model = build_model(None, name, tokenizer)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tokenizer)
    assert next(model.parameters()).dtype == torch.float32
    assert set(model._no_split_modules) == {"LlamaDecoderLayer"}  # what FSDP2 wraps, one unit per layer
    assert model.config._attn_implementation == "sdpa"  # PyTorch scaled_dot_product_attention (flash kernels on GPU)


def test_unknown_named_config_is_an_error(tokenizer) -> None:
    with pytest.raises(ValueError, match="unknown --model_config 'gpt-9'"):
        build_model(None, "gpt-9", tokenizer)


def test_config_overrides_change_the_named_config_before_it_is_built(tokenizer) -> None:
    """The benchmark's shape: GPT-2's vocabulary whatever the tokenizer, longer sequences."""
    model = build_model(None, "llama-tiny", tokenizer, config_overrides="vocab_size=50304,max_position_embeddings=256")
    assert model.get_output_embeddings().weight.shape[0] == 50304 and model.config.max_position_embeddings == 256
    with pytest.raises(ModelError, match="--config_overrides 'vocab_sise=5': .*vocab_sise"):
        build_model(None, "llama-tiny", tokenizer, config_overrides="vocab_sise=5")


def test_a_local_pretrained_directory_loads_with_its_tokenizer(tmp_path, tokenizer) -> None:
    """--model_name_or_path takes a Hub id or a local directory; the weights come back as saved."""
    saved = build_model(None, "llama-tiny", tokenizer)
    saved.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = build_model(str(tmp_path), "ignored-when-a-path-is-given", build_tokenizer(str(tmp_path), None))
    for (name, expected), (_, actual) in zip(saved.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(expected, actual), name


def test_gradient_checkpointing_is_switched_on(tokenizer) -> None:
    model = build_model(None, "llama-tiny", tokenizer, gradient_checkpointing=True)
    assert model.is_gradient_checkpointing


def test_the_shipped_tokenizer_round_trips_text(tokenizer) -> None:
    text = "Once upon a time, 12 + 7 = 19. Unicode too: café ✓"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


@pytest.mark.parametrize(("overrides", "shape"), [
    ("hidden_size=128", (32, 352)),  # the heads' width and the MLP's follow the hidden size, as the config derived them
    ("num_attention_heads=8,num_key_value_heads=8", (32, 688)),
    ("hidden_size=128,intermediate_size=200", (32, 200)),  # set: kept
    ("hidden_size=128,num_attention_heads=2,num_key_value_heads=2,head_dim=64", (64, 352)),
])
def test_overrides_of_a_size_carry_what_the_config_derived_from_it(overrides, shape, tokenizer) -> None:
    """Before, `hidden_size=128` on llama-small kept heads of 64: attention twice as wide as asked (issue 55)."""
    model = build_model(None, "llama-small", tokenizer, config_overrides=overrides)
    head_dim, mlp = shape
    assert (model.config.head_dim, model.config.intermediate_size) == shape
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (model.config.num_attention_heads * head_dim, model.config.hidden_size)
    assert model.model.layers[0].mlp.up_proj.weight.shape == (mlp, model.config.hidden_size)


def test_a_head_width_that_does_not_fill_the_hidden_size_is_refused_in_one_line(tokenizer) -> None:
    with pytest.raises(ModelError, match=r"4 heads of head_dim 64 are 256 wide, and hidden_size is 128; drop head_dim"):
        build_model(None, "llama-small", tokenizer, config_overrides="hidden_size=128,head_dim=64")
