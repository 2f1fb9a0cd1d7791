"""Pre-tokenised shards (`scripts/prepare_data.py` writes them, `--dataset_path` trains from them).

The format is `datasets`' own: `DatasetDict.save_to_disk` (one directory per split of memory-mapped Arrow
shards, `input_ids` and `labels` per sequence), plus `manifest.json`:

    {"format": "datasets-arrow", "tokenizer_fingerprint": "...", "tokenizer": "...", "block_size": 256,
     "packing": true, "splits": {"train": 2904, "validation": 152}, "tokens": {...}, "source": "..."}

Every rank of every node memory-maps the same files (a shared filesystem), so nothing is tokenised or held
twice. The fingerprint is a hash of the tokenizer's vocabulary, rules and special tokens: shards made with
another tokenizer, or another block size, are refused instead of trained on as garbage ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from datasets import Dataset, DatasetDict, load_from_disk
from transformers import PreTrainedTokenizerBase

from training.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "datasets-arrow"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """What decides the ids a text gets: the fast tokenizer's whole definition, and the EOS appended to documents."""
    definition = json.dumps([tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id])
    return hashlib.sha256(definition.encode()).hexdigest()[:16]


def write_shards(splits: dict[str, Dataset], directory: Path, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str,
                 block_size: int, packing: bool, source: str, num_shards: int | None = None) -> dict:
    """Save the tokenised splits and their manifest (written last: a directory without one is incomplete)."""
    directory.mkdir(parents=True, exist_ok=True)
    DatasetDict(splits).save_to_disk(str(directory), num_shards={name: num_shards or 1 for name in splits})
    manifest = {"format": FORMAT, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "tokenizer": tokenizer_name,
                "block_size": block_size, "packing": packing, "splits": {name: len(split) for name, split in splits.items()},
                "tokens": {name: token_count(split) for name, split in splits.items()}, "source": source}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def token_count(split: Dataset) -> int:
    """Tokens in a split, read a batch at a time (a split may not fit in memory)."""
    return sum(len(ids) for batch in split.select_columns("input_ids").iter(batch_size=10_000) for ids in batch["input_ids"])


def read_manifest(directory: str) -> dict:
    """The manifest of a `--dataset_path` directory, or one error line saying what is wrong with it."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DataError(f"--dataset_path {directory} has no {MANIFEST}: write it with scripts/prepare_data.py "
                        "(an interrupted run leaves none)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise DataError(f"{path} is not valid JSON ({error}); write the shards again with scripts/prepare_data.py") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def load_shards(directory: str, tokenizer: PreTrainedTokenizerBase, block_size: int, packing: bool) -> tuple[Dataset, Dataset]:
    """The train and validation splits, memory-mapped, after checking they were made for this tokenizer and shape."""
    manifest = read_manifest(directory)
    if manifest["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise DataError(f"--dataset_path {directory} was tokenised with {manifest['tokenizer']} (fingerprint "
                        f"{manifest['tokenizer_fingerprint']}), not this run's tokenizer ({tokenizer_fingerprint(tokenizer)}): "
                        "its ids would mean other tokens; prepare the data again with this tokenizer, or train with that one")
    if (manifest["block_size"], manifest["packing"]) != (block_size, packing):
        raise DataError(f"--dataset_path {directory} holds sequences of block size {manifest['block_size']} (packing "
                        f"{str(manifest['packing']).lower()}), this run asks for {block_size} (packing "
                        f"{str(packing).lower()}); pass --block_size {manifest['block_size']}, or prepare the data again")
    splits = load_from_disk(directory)
    if "validation" not in splits:
        raise DataError(f"--dataset_path {directory} has no validation split; prepare it with one")
    if packing:  # equal lengths: tensors straight from the memory-mapped columns
        splits = splits.with_format("torch")
    return splits["train"], splits["validation"]
