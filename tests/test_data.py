"""Packing, the local file formats and the embedded default corpus (images: tests/test_images.py)."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from data import DataError, TextReading, build_lm_datasets, load_raw_datasets
from data.default_corpus import default_splits, generate_documents
from data.packing import pack_sequences, tokenize_and_pack
from models.language import build_tokenizer
from training import tasks

pytestmark = pytest.mark.quick  # every test here: the quick tier (pytest -m quick)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(None, None)


def test_pack_sequences_concatenates_and_drops_the_short_tail() -> None:
    blocks = pack_sequences([[1, 2, 3], [4, 5], [6, 7, 8, 9]], block_size=4)
    assert blocks == [[1, 2, 3, 4], [5, 6, 7, 8]]  # 9 is the incomplete tail


def test_tokenize_and_pack_ends_each_document_with_eos(tokenizer) -> None:
    batch = {"text": ["one two", "", "three"]}
    packed = tokenize_and_pack(batch, tokenizer, "text", block_size=2)
    stream = [token for block in packed["input_ids"] for token in block]
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    expected = ids("one two") + [tokenizer.eos_token_id] + ids("three") + [tokenizer.eos_token_id]
    assert stream == expected[: len(expected) // 2 * 2]
    assert packed["labels"] == packed["input_ids"]


ONE_PER_LINE = TextReading(sample_by="line")  # how write_dataset's .txt holds documents (other formats: no effect)


def write_dataset(path, documents: list[str]) -> None:
    """Write `documents` in the format that `path`'s suffix names (.txt: one per line)."""
    suffix = path.suffix
    if suffix == ".txt":
        path.write_text("\n".join(documents))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps({"text": d}) for d in documents))
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": d} for d in documents]))
    elif suffix == ".csv":
        pd.DataFrame({"text": documents}).to_csv(path, index=False)
    elif suffix == ".parquet":
        pd.DataFrame({"text": documents}).to_parquet(path)


@pytest.mark.parametrize("suffix", [".txt", ".json", ".jsonl", ".csv", ".parquet"])
def test_local_files_become_packed_blocks(suffix, tmp_path, tokenizer, text_documents) -> None:
    train_file, validation_file = tmp_path / f"train{suffix}", tmp_path / f"validation{suffix}"
    write_dataset(train_file, text_documents)
    write_dataset(validation_file, text_documents[:40])
    raw = load_raw_datasets(None, None, str(train_file), str(validation_file), 5, seed=0, text=ONE_PER_LINE)
    assert raw["train"].num_rows == len(text_documents)
    train_set, eval_set = build_lm_datasets(raw, tokenizer, "text", block_size=32)
    assert len(train_set) > 10 and len(eval_set) > 1
    assert train_set[0]["input_ids"].shape == (32,)


def test_packing_is_cached_and_reused(tmp_path, tokenizer, text_documents) -> None:
    train_file = tmp_path / "train.txt"
    write_dataset(train_file, text_documents)
    raw = load_raw_datasets(None, None, str(train_file), None, 10, seed=0, text=ONE_PER_LINE)
    first, _ = build_lm_datasets(raw, tokenizer, "text", block_size=32)
    again, _ = build_lm_datasets(raw, tokenizer, "text", block_size=32)
    other, _ = build_lm_datasets(raw, tokenizer, "text", block_size=16)
    assert first.cache_files == again.cache_files  # the second call read the first one's cache file
    assert other.cache_files != first.cache_files  # a different block size is a different cache


def test_a_train_file_alone_is_split_for_validation(tmp_path, tokenizer, text_documents) -> None:
    train_file = tmp_path / "train.txt"
    write_dataset(train_file, text_documents)
    raw = load_raw_datasets(None, None, str(train_file), None, validation_split_percentage=10, seed=0, text=ONE_PER_LINE)
    assert (raw["train"].num_rows, raw["validation"].num_rows) == (180, 20)


def test_a_local_dataset_directory_loads_by_name(tmp_path, tokenizer, text_documents) -> None:
    """--dataset_name takes Hub ids and local dataset directories alike."""
    (tmp_path / "my_dataset").mkdir()
    write_dataset(tmp_path / "my_dataset" / "train.jsonl", text_documents)
    raw = load_raw_datasets(str(tmp_path / "my_dataset"), None, None, None, 10, seed=0)
    assert raw["train"].num_rows + raw["validation"].num_rows == len(text_documents)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [("train.xml", "<a/>", "unsupported data file type '.xml'"), ("missing.txt", None, "data file not found"),
     # one error line naming the file and its 1-based line, not pyarrow's 0-based row in a long traceback
     ("train.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": "c}\n', r"train.jsonl: line 3 is not a valid JSON record"),
     ("train.json", '[{"text": "a"},\n{"text": "b"\n]\n', r"train.json: line 3 is not valid JSON"),
     ("train.csv", 'text\n"a"\n"b\nc\n', r"train.csv: line 3 is not valid CSV .*a quoted field that never closes"),
     ("train.csv", "text,label\na,1\nb,1,2\n", r"train.csv: line 3 has 3 fields where the header has 2")],
)
def test_bad_data_files_are_named(tmp_path, name, content, message) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_raw_datasets(None, None, str(path), None, 5, seed=0)


def test_a_missing_text_column_is_named(tmp_path, tokenizer, text_documents) -> None:
    train_file = tmp_path / "train.jsonl"
    write_dataset(train_file, text_documents)
    raw = load_raw_datasets(None, None, str(train_file), None, 10, seed=0)
    with pytest.raises(ValueError, match="text column 'body' not found"):
        build_lm_datasets(raw, tokenizer, "body", block_size=32)


@pytest.mark.parts("sft")
def test_another_tasks_data_names_that_task(tmp_path, tokenizer) -> None:
    """Prompt/completion records given to the causal LM: the message names the task whose data they are."""
    train_file = tmp_path / "pairs.jsonl"
    train_file.write_text("\n".join(json.dumps({"prompt": f"q {i}", "completion": "a"}) for i in range(40)))
    raw = load_raw_datasets(None, None, str(train_file), None, 10, seed=0)
    with pytest.raises(DataError, match=re.escape("columns: ['prompt', 'completion']); this is another task's data: "
                                                  "fine-tune on it with --task sft")):
        build_lm_datasets(raw, tokenizer, "text", block_size=32, task_hint=tasks.other_task_hint)


def test_default_corpus_is_deterministic_and_held_out() -> None:
    assert generate_documents(50, seed=3) == generate_documents(50, seed=3)
    splits = default_splits(num_train=2000, num_validation=100)
    assert not set(splits["validation"]) & set(splits["train"])


CHAT = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]} for i in range(40)]


@pytest.mark.parametrize(
    ("records", "core_only", "message"),
    [pytest.param(CHAT, False, "'messages' holds lists of {role, content} messages: this is chat data; fine-tune on it "
                  "with --task sft", marks=pytest.mark.parts("sft")),  # the task that reads it, named by its part
     (CHAT, True, "'messages' holds lists of {role, content} messages: this is chat data; no installed --task reads it"),
     ([{"messages": i} for i in range(40)], False, "'messages' holds int values, not text")],
)
def test_a_text_column_that_does_not_hold_text_is_named(tmp_path, tokenizer, monkeypatch, records, core_only, message) -> None:
    """A column of chat messages names the installed task that reads them (a part's TaskEntry.data_columns), if any."""
    if core_only:  # as in a project without the parts (scripts/new_project.py)
        monkeypatch.setattr(tasks, "part_tasks", dict)
    train_file = tmp_path / "chat.jsonl"
    train_file.write_text("\n".join(json.dumps(record) for record in records))
    raw = load_raw_datasets(None, None, str(train_file), None, 10, seed=0)
    with pytest.raises(DataError, match=re.escape(message)):
        build_lm_datasets(raw, tokenizer, "messages", block_size=32, task_hint=tasks.other_task_hint)


def test_unpacked_documents_pad_to_a_multiple_of_8_with_ignored_labels(tokenizer) -> None:
    from data import make_collator

    batch = make_collator(tokenizer, packing=False)([{"input_ids": [5] * n, "labels": [5] * n} for n in (3, 11)])
    assert batch["input_ids"].shape == (2, 16) and batch["labels"].shape == (2, 16)
    assert (batch["labels"][0, 3:] == -100).all() and (batch["labels"][1, 11:] == -100).all()
    assert batch["attention_mask"].sum().item() == 3 + 11
