"""Causal LM datasets: documents from the Hub, local files or the embedded corpus, packed into blocks (or padded per
batch with --packing false); tokenized once, main process first, and cached under HF_DATASETS_CACHE for the rest."""

from __future__ import annotations

import copy
import glob
import hashlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import datasets
from datasets import Dataset, DatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase, default_data_collator

from data.default_corpus import CORPUS_VERSION, default_splits
from data.file_errors import describe_unreadable
from data.packing import tokenize_and_pack, tokenize_documents
from training.errors import DataError

FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
PACKING_VERSION = "2"  # bump when packing changes, so old caches are not reused


@dataclass(frozen=True)
class TextReading:
    """How `.txt` files become documents (`--sample_by`, `--keep_linebreaks`): the whole file as written by default,
    so the model sees its line breaks and blank lines, and the end-of-text token only between documents."""

    sample_by: str = "document"  # or "paragraph" (documents separated by blank lines), "line"
    keep_linebreaks: bool = True  # "line": each line keeps its line break (transformers' run_clm default)

    def options(self, builder: str) -> dict:
        """`load_dataset` keyword arguments for `builder` (the text builder's own; none for other formats)."""
        return {"sample_by": self.sample_by, "keep_linebreaks": self.keep_linebreaks} if builder == "text" else {}


def check_data_file(path: str) -> str:
    """The `datasets` builder for a local data file or glob pattern of them; a clear error if it cannot be used."""
    suffix = Path(path).suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise ValueError(f"unsupported data file type {suffix!r} ({path}); use one of {sorted(FILE_BUILDERS)}")
    pattern = any(character in path for character in "*?[")
    if not (glob.glob(path) if pattern else Path(path).is_file()):
        raise FileNotFoundError(f"data file not found: {path}; check --train_file/--validation_file")
    if not pattern and Path(path).stat().st_size == 0:  # a pattern's empty files: see --skip_bad_shards
        raise ValueError(f"data file is empty: {path}")
    return FILE_BUILDERS[suffix]


def local_files(train_file: str, validation_file: str | None) -> tuple[str, dict[str, str]]:
    """The `datasets` builder and the `data_files` of --train_file/--validation_file, one format for both."""
    files = {"train": train_file} | ({"validation": validation_file} if validation_file else {})
    builders = {check_data_file(path) for path in files.values()}
    if len(builders) > 1:
        raise DataError("--train_file and --validation_file must have the same format")
    return builders.pop(), files


def load_raw_datasets(dataset_name: str | None, dataset_config_name: str | None, train_file: str | None,
                      validation_file: str | None, validation_split_percentage: int, seed: int,
                      text: TextReading = TextReading()) -> DatasetDict:
    """A `DatasetDict` with `train` and `validation` splits of raw documents."""
    if dataset_name:
        raw = load_dataset(dataset_name, dataset_config_name)
    elif train_file:
        builder, files = local_files(train_file, validation_file)
        try:
            raw = load_dataset(builder, data_files=files, **text.options(builder))
        except DatasetGenerationError as error:  # a malformed line: name the file and line, not pyarrow's row
            raise DataError(describe_unreadable(files, builder, error.__cause__ or error)) from None
    else:
        raw = DatasetDict({split: Dataset.from_dict({"text": docs}) for split, docs in default_splits().items()})
    if "validation" not in raw:
        raw = hold_out(raw["train"], validation_split_percentage, seed)
    return raw


def hold_out(train: Dataset, percentage: int, seed: int, stratify_by_column: str | None = None) -> DatasetDict:
    """`percentage` of `train` held out for validation, stratified if every `stratify_by_column` class can give some;
    of each document's lines where there are too few documents to give some up (a text file read whole)."""
    try:
        split = train.train_test_split(test_size=percentage / 100, seed=seed, stratify_by_column=stratify_by_column)
    except ValueError:  # a class too small to split, or a split that would leave either side empty
        if stratify_by_column:
            return hold_out(train, percentage, seed)
        if ends := held_out_ends(train, percentage):
            return ends
        raise DataError(
            f"{len(train)} training examples cannot give up --validation_split_percentage {percentage} for "
            "validation; add data, change the percentage, or give a validation file or directory") from None
    return DatasetDict({"train": split["train"], "validation": split["test"]})


def held_out_ends(train: Dataset, percentage: int, column: str = "text") -> DatasetDict | None:
    """The last `percentage` of every document's lines for validation, the rest for training, as nanoGPT holds out
    the end of its text (each a `map` of `train`: cached by its fingerprint); None where no document has lines to
    spare."""
    if column not in train.column_names:
        return None
    ends = DatasetDict({split: train.map(document_lines, batched=True, remove_columns=train.column_names,
                                          fn_kwargs={"column": column, "percentage": percentage, "head": split == "train"})
                        for split in ("train", "validation")})
    return ends if len(ends["train"]) else None


def document_lines(batch: dict[str, list], column: str, percentage: int, head: bool) -> dict[str, list[str]]:
    """`datasets.map` function: each document's first `100 - percentage` percent of lines (`head`), else the rest;
    documents of one line are left out."""
    kept = []
    for text in batch[column]:
        lines = text.splitlines(keepends=True) if isinstance(text, str) else []
        cut = min(len(lines) - 1, round(len(lines) * (100 - percentage) / 100))
        if cut >= 1:
            kept.append("".join(lines[:cut] if head else lines[cut:]))
    return {column: kept}


def cache_key(split: Dataset, embedded: str, tokenizer: PreTrainedTokenizerBase, *settings) -> str:
    """A tokenized split's key: source (a fingerprint, or `embedded` version), tokenizer, chat template, `settings`."""
    source = split._fingerprint if split.cache_files else f"{embedded}-{len(split)}"
    parts = [source, tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template, *settings]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def check_plain_text(split: Dataset, text_column: str, task_hint: Callable[[set[str]], str | None]) -> None:
    """The text column holds strings: chat conversations (lists of {role, content}) cannot be packed as text."""
    values = [value for value in split[:100][text_column] if value is not None]
    if not values or all(isinstance(value, str) for value in values):
        return
    first = next(value for value in values if not isinstance(value, str))
    if isinstance(first, list) and first and isinstance(first[0], dict) and {"role", "content"} <= first[0].keys():
        raise DataError(f"--text_column {text_column!r} holds lists of {{role, content}} messages: this is chat data; "
                        + (task_hint({"messages"}) or "no installed --task reads it"))
    raise DataError(f"--text_column {text_column!r} holds {type(first).__name__} values, not text; choose a column of strings")


def build_lm_datasets(raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, text_column: str, block_size: int,
                      main_process_first: AbstractContextManager | None = None, packing: bool = True,
                      num_proc: int | None = None,
                      task_hint: Callable[[set[str]], str | None] = lambda columns: None) -> tuple[Dataset, Dataset]:
    """Both splits as sequences of at most `block_size` tokens, cached by the main process first (any `num_proc`).
    `task_hint(columns)`: what to do with another task's data (training/tasks.py names the installed task)."""
    for split in raw.values():
        if text_column not in split.column_names:
            hint = task_hint(set(split.column_names))
            raise DataError(f"text column {text_column!r} not found (columns: {split.column_names}); "
                            + (f"this is another task's data: {hint}" if hint else "set --text_column"))
        check_plain_text(split, text_column, task_hint)
    cache_dir = Path(datasets.config.HF_DATASETS_CACHE) / "packed"
    cache_dir.mkdir(parents=True, exist_ok=True)
    packed = {}
    with main_process_first or nullcontext():
        for name, split in raw.items():
            key = cache_key(split, f"default-corpus-{CORPUS_VERSION}", tokenizer, text_column, block_size, packing,
                            PACKING_VERSION)
            packed[name] = split.map(
                tokenize_and_pack if packing else tokenize_documents, batched=True, batch_size=1000,
                remove_columns=split.column_names,
                fn_kwargs={"tokenizer": tokenizer, "text_column": text_column, "block_size": block_size},
                cache_file_name=str(cache_dir / f"{key}.arrow"), new_fingerprint=key, num_proc=num_proc,
                desc=f"Tokenizing {name}")
            if packing:  # equal lengths: tensors straight from the dataset
                packed[name] = packed[name].with_format("torch")
    return packed["train"], packed["validation"]


PAD_TO_MULTIPLE_OF = 8


def make_collator(tokenizer: PreTrainedTokenizerBase, packing: bool):
    """Padded to a multiple of 8 tokens (labels -100): tensor cores want it, and torch.compile recompiles less."""
    if packing:
        return default_data_collator
    # Right padding whatever the tokenizer's side: left padding shifts positions, so the loss would depend on batching.
    right_padding = copy.copy(tokenizer)
    right_padding.padding_side = "right"
    return DataCollatorForSeq2Seq(right_padding, label_pad_token_id=-100, pad_to_multiple_of=PAD_TO_MULTIPLE_OF)
