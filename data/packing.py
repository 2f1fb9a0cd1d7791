"""Tokenize documents into training sequences: packed into full blocks, or one per document."""

from __future__ import annotations

from itertools import chain
from typing import Any

from transformers import PreTrainedTokenizerBase


def pack_sequences(sequences: list[list[int]], block_size: int) -> list[list[int]]:
    """Concatenated and cut into `block_size` blocks; the short tail is dropped, so no padding or attention mask."""
    stream = list(chain.from_iterable(sequences))
    usable = len(stream) // block_size * block_size
    return [stream[i : i + block_size] for i in range(0, usable, block_size)]


def tokenize_and_pack(batch: dict[str, list[Any]], tokenizer: PreTrainedTokenizerBase, text_column: str,
                      block_size: int) -> dict[str, list[list[int]]]:
    """`datasets.map` function: documents in, `input_ids`/`labels` blocks out; EOS ends each to mark where it stops."""
    texts = [text for text in batch[text_column] if text]
    token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    blocks = pack_sequences([ids + [tokenizer.eos_token_id] for ids in token_ids], block_size)
    return {"input_ids": blocks, "labels": [list(block) for block in blocks]}


def tokenize_documents(batch: dict[str, list[Any]], tokenizer: PreTrainedTokenizerBase, text_column: str,
                       block_size: int) -> dict[str, list[list[int]]]:
    """`datasets.map` function without packing: one sequence per document, cut at `block_size`; padded per batch."""
    texts = [text for text in batch[text_column] if text]
    token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    sequences = [(ids + [tokenizer.eos_token_id])[:block_size] for ids in token_ids]
    sequences = [ids for ids in sequences if len(ids) >= 2]  # one token predicts nothing
    return {"input_ids": sequences, "labels": [list(ids) for ids in sequences]}
