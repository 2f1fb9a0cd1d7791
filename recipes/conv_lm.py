"""Recipe: a plain `nn.Module` language model wrapped once for `transformers` (docs/models-and-data.md, "Custom
models"), so that its export loads anywhere with `from_pretrained`. recipes/conv_lm_task.py trains it.

1. Write the `nn.Module`: token ids in, logits out (here `ConvLanguageModel`).
2. Wrap it once: a `PretrainedConfig` holding its sizes, and a `PreTrainedModel` whose
   `forward` returns `CausalLMOutput(logits=...)` (here `ConvLMConfig`, `ConvLMForCausalLM`).
   `_no_split_modules` names the block FSDP2 and ZeRO-3 shard as a unit.
3. Register it: `register_custom_model` below, called by the task that builds it.
`final/` then loads outside this repository with `AutoModelForCausalLM.from_pretrained(path,
trust_remote_code=True)`: the export carries this file (`register_for_auto_class`), which
therefore imports only torch and transformers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class ConvBlock(nn.Module):
    """Pre-norm residual block: a causal depthwise convolution mixes neighbouring tokens, an MLP mixes channels."""

    def __init__(self, hidden_size: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.mix_norm = nn.LayerNorm(hidden_size)
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel_size, groups=hidden_size)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mixed = self.mix_norm(hidden).transpose(1, 2)  # (batch, channels, tokens)
        mixed = self.conv(nn.functional.pad(mixed, (self.kernel_size - 1, 0)))  # left padding: no token sees the future
        hidden = hidden + mixed.transpose(1, 2)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ConvLanguageModel(nn.Module):
    """Your model: any `nn.Module` from token ids to next-token logits."""

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, kernel_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(ConvBlock(hidden_size, kernel_size) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


class ConvLMConfig(PretrainedConfig):
    model_type = "conv-lm"

    def __init__(self, vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2, kernel_size: int = 4,
                 max_position_embeddings: int = 128, **kwargs) -> None:
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers
        self.kernel_size, self.max_position_embeddings = kernel_size, max_position_embeddings
        super().__init__(**kwargs)


class ConvLMForCausalLM(PreTrainedModel, GenerationMixin):
    """The wrapper: `transformers`' saving, loading, initialisation and `generate` around `ConvLanguageModel`."""

    config_class = ConvLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["ConvBlock"]

    def __init__(self, config: ConvLMConfig) -> None:
        super().__init__(config)
        self.model = ConvLanguageModel(config.vocab_size, config.hidden_size, config.num_layers, config.kernel_size)
        self.post_init()
        self.generation_config.use_cache = False  # no key/value cache: `generate` reruns the whole sequence

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        # Causal and position-free: padding sits after a document's tokens, so they never see it.
        return CausalLMOutput(logits=self.model(input_ids))


def register_custom_model() -> None:
    """Make the model known to the Auto classes here, and have `save_pretrained` copy this file
    into the export with an `auto_map` (the trust_remote_code path)."""
    AutoConfig.register(ConvLMConfig.model_type, ConvLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(ConvLMConfig, ConvLMForCausalLM, exist_ok=True)
    ConvLMConfig.register_for_auto_class()
    ConvLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")
