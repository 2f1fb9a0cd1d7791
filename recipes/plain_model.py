"""Recipe (a): your own model as a plain PyTorch `nn.Module`, trained under every config file.

    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --task recipes.plain_model:TinyLMTask

The core's causal-LM task (its corpus, tokenizer, data and loss) with the model swapped for `TinyLM` below:
token ids in, logits out, nothing from `transformers`. `final/` then holds `model.safetensors` and `model.json`
(this class and `model_kwargs`), and `training.checkpoint.load_plain_model(final_dir)` rebuilds it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from training.checkpoints.save import load_plain_model
from training.performance import flops_per_token
from training.tasks import CausalLM


class Block(nn.Module):
    """Pre-norm causal self-attention, then an MLP, each added to the residual stream."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, tokens, 3, self.heads, -1).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, tokens, hidden)
        x = x + self.out(attended)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """A small decoder-only language model."""

    _no_split_modules = ["Block"]  # FSDP2 (fsdp.yaml's TRANSFORMER_BASED_WRAP) shards each Block as one unit

    def __init__(self, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, max_length: int = 128) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab_size, hidden), nn.Embedding(max_length, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TinyLMTask(CausalLM):
    """The causal-LM task, training `TinyLM`."""

    can_build_empty = False  # every rank builds the whole model: seeded alike, the same weights

    def build_model(self, raw, empty: bool = False) -> nn.Module:
        self.block_size = self.data_args.block_size or 128
        self.model_kwargs = {"vocab_size": len(self.processor), "max_length": self.block_size}  # final/model.json
        model = TinyLM(**self.model_kwargs)
        self.flops_per_unit = flops_per_token(model, self.block_size)  # 6 x parameters, for MFU
        self.settings = {"block_size": self.block_size}
        return model

    def forward(self, model: nn.Module, batch: dict) -> torch.Tensor:
        output = model(batch["input_ids"])
        return getattr(output, "logits", output)  # (a transformers model run on this task: a distillation teacher)

    def sample(self, final_dir: Path) -> str:
        """Greedy continuation of --sample_prompt by the model rebuilt from final/."""
        model = load_plain_model(final_dir).eval()
        ids = self.processor(self.data_args.sample_prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            for _ in range(20):
                ids = torch.cat([ids, model(ids[:, -self.block_size:])[:, -1:].argmax(-1)], dim=1)
        return repr(self.processor.decode(ids[0], skip_special_tokens=True))
