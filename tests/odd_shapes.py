"""A plain `nn.Module` task whose tensors no strategy divides evenly: what a user brings, not the template's model.

Tensors with odd and prime sizes (a 7 x 13 weight, a 5-element bias, a 1-element gate), a 0-dim parameter, a float64
parameter, an int64 and a float64 buffer that float32 would round, an output layer tied to the input embedding, a
frozen layer and BatchNorm statistics, trained as a causal LM on the default corpus:
`--task tests.odd_shapes:OddShapesTask`.
"""

from __future__ import annotations

import torch
from torch import nn

from training.tasks import CausalLM, Task

WIDTH = 13  # prime: neither 2, 3 nor 4 processes divide a row, nor (with the vocabulary) a matrix


class OddShapes(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)  # left as initialised (requires_grad False)
        self.narrow = nn.Linear(WIDTH, 7, bias=False)  # a 7 x 13 weight (a bias before BatchNorm gets no gradient)
        self.norm = nn.BatchNorm1d(7)  # running statistics: buffers the checkpoint carries
        self.odd = nn.Linear(7, 5)  # a 5-element bias
        self.wide = nn.Linear(5, WIDTH, bias=False)
        self.gate = nn.Parameter(torch.full((1,), 0.5))  # one element
        self.temperature = nn.Parameter(torch.tensor(1.0))  # 0-dim: a learned temperature, as CLIP's logit_scale
        self.scale64 = nn.Parameter(torch.ones(5, dtype=torch.float64))  # float64
        self.register_buffer("tokens_seen", torch.tensor(2**24 + 1))  # int64, past what float32 holds exactly
        self.register_buffer("offset64", torch.full((3,), 1 + 1e-12, dtype=torch.float64))  # float64, below float32's step
        self.head = nn.Linear(WIDTH, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.1)  # logits of a sensible size through the tied head
        self.frozen.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        x = x + self.frozen(x)
        h = self.narrow(x)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        x = x + self.gate * self.wide(torch.tanh(self.odd(h)) * self.scale64.to(h.dtype))
        return self.head(x) * self.temperature


class OddShapesTask(CausalLM):
    """The core's causal-LM task, training `OddShapes`."""

    can_build_empty = False  # every rank builds the whole model, seeded alike

    def build_model(self, raw, empty: bool = False) -> nn.Module:
        self.block_size = self.data_args.block_size or 32
        self.model_kwargs = {"vocab_size": len(self.processor)}
        self.settings = {"block_size": self.block_size}
        return OddShapes(**self.model_kwargs)

    def forward(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return model(batch["input_ids"])

    sample = Task.sample  # (no generation: the exported model is not a transformers one)
