"""A model cut into consecutive pipeline stages: which layers go where, and each stage's forward.

Model knowledge only (training/pipeline.py runs the stages): a decoder-only causal LM of the
Llama family (Llama, Qwen2/3, Mistral: `model.embed_tokens`, `model.layers`, `model.norm`,
`lm_head`) puts its embeddings on the first stage, its decoder layers balanced over the
stages and its norm and head on the last; a ResNet puts its stem first, its residual blocks
balanced, and its pooler and classifier last. Each stage holds the model's own modules, so
its parameters are the model's (`full_name` maps a stage's names back to the model's).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from models.language import ModelError

SUPPORTED = "decoder-only Llama-family causal LMs (Llama, Qwen2, Qwen3, Mistral) and ResNet image classifiers"


class StageError(ModelError):
    """A model or a split that pipeline stages cannot hold; the message says what is supported."""


def balanced(count: int, stages: int) -> list[range]:
    """`count` layers over `stages` stages, in order, the first `count % stages` stages one layer more."""
    if count < stages:
        raise StageError(f"{count} layers cannot fill {stages} pipeline stages (each needs at least one); "
                         "use fewer stages (--pipeline_parallel_size, and Interleaved1F1B's two per process)")
    size, extra = divmod(count, stages)
    bounds = [0]
    for stage in range(stages):
        bounds.append(bounds[-1] + size + (stage < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class DecoderStage(nn.Module):
    """Decoder layers `layers` of a Llama-family model; with the embeddings first, the norm and head last."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        decoder = model.model
        self.config = model.config
        self.embed_tokens = decoder.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(index): decoder.layers[index] for index in layers})
        self.norm = decoder.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = copy.deepcopy(decoder.rotary_emb)  # buffers only; every stage needs the angles

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states, or logits (last stage), out."""
        from transformers.masking_utils import create_causal_mask

        if self.embed_tokens is not None:
            hidden = self.embed_tokens(hidden)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # Causal attention over whole sequences: packed blocks have no padding to mask.
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=positions)
        angles = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_embeddings=angles, position_ids=positions)
        if self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden

    @staticmethod
    def full_name(name: str) -> str:
        return name if name.startswith("lm_head.") else f"model.{name}"


class ResNetStage(nn.Module):
    """Residual blocks `blocks` (counted over all of the encoder's stages) of a ResNet classifier; with the
    stem first, the pooler and classifier last."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        every_block = [(f"encoder.stages.{s}.layers.{b}", block) for s, stage in enumerate(model.resnet.encoder.stages)
                       for b, block in enumerate(stage.layers)]
        self.embedder = model.resnet.embedder if first else None
        self.blocks = nn.ModuleDict({every_block[i][0].replace(".", "|"): every_block[i][1] for i in blocks})
        self.pooler = model.resnet.pooler if last else None
        self.classifier = model.classifier if last else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pixels (first stage) or feature maps in; feature maps, or logits (last stage), out."""
        if self.embedder is not None:
            hidden = self.embedder(hidden)
        for block in self.blocks.values():
            hidden = block(hidden)
        if self.classifier is not None:
            hidden = self.classifier(self.pooler(hidden))
        return hidden

    @staticmethod
    def full_name(name: str) -> str:
        if name.startswith("blocks."):
            return "resnet." + name.removeprefix("blocks.").replace("|", ".")
        return name if name.startswith("classifier.") else f"resnet.{name}"


def split_into_stages(model: nn.Module, stages: int) -> list[nn.Module]:
    """`model` as `stages` consecutive stage modules sharing its parameters; StageError for other models."""
    if all(hasattr(model, "model") and hasattr(model.model, name) for name in ("embed_tokens", "layers", "norm")) \
            and hasattr(model, "lm_head"):
        if model.config.tie_word_embeddings and stages > 1:
            raise StageError("this model ties its output layer to its input embedding, which would live on the first "
                             "and last pipeline stages at once; pipeline stages need untied embeddings "
                             "(tie_word_embeddings: false), or train it with a data-parallel config")
        return [DecoderStage(model, layers, index == 0, index == stages - 1)
                for index, layers in enumerate(balanced(len(model.model.layers), stages))]
    if hasattr(model, "resnet") and hasattr(model, "classifier"):
        count = sum(len(stage.layers) for stage in model.resnet.encoder.stages)
        return [ResNetStage(model, blocks, index == 0, index == stages - 1)
                for index, blocks in enumerate(balanced(count, stages))]
    raise StageError(f"pipeline stages are defined for {SUPPORTED}, not {type(model).__name__}; "
                     "train it with a data-parallel config, or add a stage split for it in parts/pipeline/stages.py")
