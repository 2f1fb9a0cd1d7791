"""Tokenize documents into training sequences: packed into full blocks, or one per document."""

from __future__ import annotations

import logging
from itertools import chain
from typing import Any

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
warned_of_cuts = False  # in this process: tokenize_documents warns once


def pack_sequences(sequences: list[list[int]], block_size: int) -> list[list[int]]:
    """Concatenated and cut into `block_size` blocks; the short tail is dropped, so no padding or attention mask."""
    stream = list(chain.from_iterable(sequences))
    usable = len(stream) // block_size * block_size
    return [stream[i : i + block_size] for i in range(0, usable, block_size)]


def tokenize_and_pack(batch: dict[str, list[Any]], tokenizer: PreTrainedTokenizerBase, text_column: str,
                      block_size: int) -> dict[str, list[list[int]]]:
    """`datasets.map` function: documents in, `input_ids`/`labels` blocks out; EOS ends each to mark where it stops.
    A document longer than the model's maximum is cut into blocks: not transformers' "indexing errors" warning."""
    texts = [text for text in batch[text_column] if text]
    token_ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    blocks = pack_sequences([ids + [tokenizer.eos_token_id] for ids in token_ids], block_size)
    return {"input_ids": blocks, "labels": [list(block) for block in blocks]}


def tokenize_documents(batch: dict[str, list[Any]], tokenizer: PreTrainedTokenizerBase, text_column: str,
                       block_size: int) -> dict[str, list[list[int]]]:
    """`datasets.map` function without packing: one sequence per document, cut at `block_size`; padded per batch.
    What a cut leaves out is never trained on: warned of once per process."""
    global warned_of_cuts
    texts = [text for text in batch[text_column] if text]
    token_ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    if not warned_of_cuts and (long := next((len(ids) + 1 for ids in token_ids if len(ids) + 1 > block_size), None)):
        logger.warning(f"a document of {long:,} tokens is longer than --block_size {block_size}: with --packing false "
                       "each document is cut to one sequence, and the rest is not trained on; pack them (--packing "
                       "true), split them (--sample_by paragraph or line) or raise --block_size")
        warned_of_cuts = True
    sequences = [(ids + [tokenizer.eos_token_id])[:block_size] for ids in token_ids]
    sequences = [ids for ids in sequences if len(ids) >= 2]  # one token predicts nothing
    return {"input_ids": sequences, "labels": [list(ids) for ids in sequences]}
