"""Streaming text (`--streaming`): documents read from their files as training needs them, never loaded whole.

Each split is a `datasets.IterableDataset` with one shard per data file: the files of a Hub or local
dataset directory (`--dataset_name`), or `--train_file`/`--validation_file` (glob patterns allowed). The
documents are tokenised and packed on the fly, as `build_lm_datasets` does with a whole set, and the shard
order is shuffled by seed and epoch. loader.py gives each rank its share
(`split_dataset_by_node`) and saves its position in checkpoints.

A file that cannot be read, or holds no documents, stops the run with one line naming it; with
`--skip_bad_shards` it is skipped, and each skip is logged with this process's count so far.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from datasets import Dataset, IterableDataset, load_dataset, load_dataset_builder
from transformers import PreTrainedTokenizerBase

from data import TextReading, local_files
from data.default_corpus import default_splits
from data.packing import tokenize_and_pack, tokenize_documents
from training.errors import DataError

logger = logging.getLogger(__name__)
skipped_shards = 0  # in this process (a loader worker counts its own)


def split_files(dataset_name: str | None, dataset_config_name: str | None, train_file: str | None,
                validation_file: str | None) -> tuple[str, dict[str, list[str]]]:
    """The `datasets` builder that reads the data ("json", "parquet", ...) and each split's files, resolved by
    `datasets` itself (directories, Hub repositories, glob patterns)."""
    if dataset_name:
        builder = load_dataset_builder(dataset_name, dataset_config_name)
    else:
        name, files = local_files(train_file, validation_file)
        try:
            builder = load_dataset_builder(name, data_files=files)
        except FileNotFoundError as error:
            raise DataError(f"no data files match: {error}") from None
    resolved = {str(split): [str(path) for path in paths] for split, paths in (builder.config.data_files or {}).items()}
    if not resolved.get("train"):
        raise DataError(f"--streaming reads a dataset's data files, and {dataset_name or train_file} lists no training "
                        "files; give --train_file or a dataset with data files")
    return builder.name, resolved


def documents(files: list[str], builder: str, text_column: str, skip_bad_shards: bool,
              text: TextReading) -> Iterator[dict[str, str]]:
    """The `text_column` of every row of `files`, in order (a generator for `IterableDataset.from_generator`, which
    makes each file a shard); a .txt file's documents as `text` reads them (--sample_by document reads a file whole)."""
    global skipped_shards
    for path in files:
        rows = 0
        try:
            # .iter, not a plain loop: inside a loader worker that would take only this worker's part of the file
            for batch in load_dataset(builder, data_files=path, split="train", streaming=True,
                                      **text.options(builder)).iter(batch_size=1000):
                if text_column not in batch:
                    raise DataError(f"{path} has no column {text_column!r} (columns: {sorted(batch)}); set --text_column")
                for text in batch[text_column]:
                    rows += 1
                    yield {text_column: text}
        except DataError:
            raise
        except StopIteration:  # datasets' json reader on an empty file
            problem = "holds no rows"
        except Exception as error:  # noqa: BLE001 - whatever datasets or pyarrow raise for a broken file
            detail = (str(error).strip().splitlines() or [""])[0][:200]
            problem = f"cannot be read after {rows} rows ({type(error).__name__}{': ' + detail if detail else ''})"
        else:
            if rows:
                continue
            problem = "holds no rows"
        if not skip_bad_shards:
            raise DataError(f"data file {path} {problem}; fix or remove it, or pass --skip_bad_shards to skip such files")
        skipped_shards += 1
        logger.warning(f"skipped data file {path}: it {problem} (--skip_bad_shards; {skipped_shards} skipped so far "
                       "by this process)")


def document_streams(dataset_name: str | None, dataset_config_name: str | None, train_file: str | None,
                     validation_file: str | None, text_column: str, skip_bad_shards: bool,
                     text: TextReading = TextReading()) -> dict[str, IterableDataset]:
    """Each split's documents as a stream, one shard per file; the embedded default corpus without data flags."""
    if not (dataset_name or train_file):
        return {split: Dataset.from_dict({text_column: docs}).to_iterable_dataset()
                for split, docs in default_splits().items()}
    builder, files = split_files(dataset_name, dataset_config_name, train_file, validation_file)
    return {split: IterableDataset.from_generator(documents, gen_kwargs={
        "files": paths, "builder": builder, "text_column": text_column, "skip_bad_shards": skip_bad_shards, "text": text})
        for split, paths in files.items()}


def block_stream(documents: IterableDataset, tokenizer: PreTrainedTokenizerBase, text_column: str, block_size: int,
                 packing: bool, seed: int | None) -> IterableDataset:
    """Documents in, training sequences out, tokenised and packed per 1,000 documents (each thousand's tail
    shorter than a block is left out); with a `seed`, the shards in an order drawn from it and the epoch
    (`set_epoch`); the loader shuffles the sequences (loader.py)."""
    # buffer 1: the shard order only (the loader shuffles sequences); one shard read at a time (a reader holds ~250 MiB)
    ordered = documents if seed is None else documents.shuffle(seed=seed, buffer_size=1, max_buffer_input_shards=1)
    return ordered.map(tokenize_and_pack if packing else tokenize_documents, batched=True, batch_size=1000,
                       remove_columns=[text_column],
                       fn_kwargs={"tokenizer": tokenizer, "text_column": text_column, "block_size": block_size})


def first_blocks(stream: IterableDataset, count: int) -> Dataset:
    """The first `count` sequences of a stream, held in memory: an evaluation set every rank builds alike."""
    blocks = list(stream.take(count))
    if not blocks:
        raise DataError("the validation stream holds no complete sequence; give more validation data or a smaller "
                        "--block_size")
    return Dataset.from_list(blocks)


def stream_datasets(raw: dict[str, IterableDataset], tokenizer: PreTrainedTokenizerBase, text_column: str, block_size: int,
                    packing: bool, seed: int, max_eval_samples: int | None) -> tuple[IterableDataset, Dataset]:
    """The training stream, and the first `max_eval_samples` validation sequences held in memory (none without)."""
    train = block_stream(raw["train"], tokenizer, text_column, block_size, packing, seed)
    blocks_format = "torch" if packing else None  # packed: equal lengths, tensors straight away
    if not max_eval_samples:  # --eval_strategy no (the part's flag check requires it otherwise)
        return train, Dataset.from_dict({"input_ids": [], "labels": []})
    if "validation" not in raw:
        raise DataError("--streaming: this data has no validation split to evaluate on (a stream cannot hold one out); "
                        "give --validation_file, a dataset with a validation split, or --eval_strategy no")
    validation = block_stream(raw["validation"], tokenizer, text_column, block_size, packing, None)
    return train, first_blocks(validation, max_eval_samples).with_format(blocks_format)
