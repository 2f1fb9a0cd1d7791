"""Text files train as written: a .txt file is one document, its line breaks and blank lines kept, with the end-of-text
token between documents only (`--sample_by`, `--keep_linebreaks`, datasets' text builder); a single text file gives up
the end of its lines for validation, as nanoGPT does; the stream and scripts/prepare_data.py read text the same way;
and transformers' long-sequence warning is not shown where packing cuts the text into blocks anyway."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

import data.packing
from data import TextReading, build_lm_datasets, load_raw_datasets
from data.default_corpus import generate_documents
from data.packing import tokenize_and_pack, tokenize_documents
from models.language import build_tokenizer
from tests.harness import TINY_RUN, train
from training.arguments import parse_args
from training.task_registry import build_task

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

BLOCK = 32
LONG_WARNING = "Token indices sequence length is longer than the specified maximum sequence length"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(None, None)


def verse(seed: int, stanzas: int = 12) -> str:
    """A play in verse: stanzas of four lines of six words, separated by blank lines, each line ending in a newline."""
    words = " ".join(generate_documents(stanzas * 8, seed)).split()
    lines = [" ".join(words[i:i + 6]).capitalize() for i in range(0, stanzas * 24, 6)]
    return "\n\n".join("\n".join(lines[i:i + 4]) for i in range(0, len(lines), 4)) + "\n"


@pytest.fixture(scope="module")
def plays(tmp_path_factory) -> Path:
    """Two plays to train on (plays/*.txt, one document each) and a third to validate on."""
    root = tmp_path_factory.mktemp("plays")
    (root / "plays").mkdir()
    for index in range(2):
        (root / "plays" / f"act{index}.txt").write_text(verse(index))
    (root / "validation.txt").write_text(verse(2, stanzas=6))
    return root


def stream_of(blocks) -> list[int]:
    return [token for block in blocks for token in block["input_ids"].tolist()]


def test_a_text_file_trains_as_written(plays, tokenizer, tmp_path) -> None:
    """What the model sees, through the tokenizer: each play as written, newlines and blank lines kept, and the
    end-of-text token only between the plays (before, each line was a document: an end-of-text after every line)."""
    flags = ("--train_file", str(plays / "plays" / "*.txt"), "--validation_file", str(plays / "validation.txt"),
             "--block_size", str(BLOCK), "--max_steps", "2", "--eval_steps", "2", "--save_strategy", "no",
             "--config_overrides", "hidden_size=32")
    result = train("single", tmp_path, *flags)
    # (the start-up log says what the narrower model derived again: its heads' width and its MLP's)
    assert "model llama-tiny: hidden 32, 2 layers, 4 heads of 8 (derived again), MLP 96 (derived again)" in result.stderr
    model_args, data_args, _ = parse_args([*TINY_RUN, *flags, "--output_dir", str(tmp_path / "same")])
    task = build_task(model_args, data_args)
    raw = task.load_raw_datasets(seed=42)
    task.build_model(raw)
    train_set, _ = task.datasets(raw, None)
    assert f"{len(train_set)} sequences of up to {BLOCK} tokens" in result.stderr
    texts = [(plays / "plays" / f"act{index}.txt").read_text() for index in range(2)]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    expected = ids[0] + [tokenizer.eos_token_id] + ids[1] + [tokenizer.eos_token_id]
    seen = stream_of(train_set)
    assert seen == expected[:len(seen)] and len(expected) - len(seen) < BLOCK  # whole blocks: the short tail is left
    assert seen.count(tokenizer.eos_token_id) == 1 and seen.index(tokenizer.eos_token_id) == len(ids[0])
    assert tokenizer.decode(seen[:len(ids[0])]) == texts[0] and "\n\n" in texts[0]


@pytest.mark.parametrize(("reading", "documents"), [
    (TextReading("paragraph"), lambda text: text.split("\n\n")),  # stanzas
    (TextReading("line"), lambda text: text.splitlines(keepends=True)),  # each line with its line break
    (TextReading("line", keep_linebreaks=False), lambda text: text.splitlines()),  # datasets' own default
], ids=["paragraph", "line", "line without line breaks"])
def test_sample_by_chooses_what_a_document_is(reading, documents, plays, tokenizer) -> None:
    path = plays / "plays" / "act0.txt"
    raw = load_raw_datasets(None, None, str(path), str(path), 5, seed=0, text=reading)
    expected = documents(path.read_text())
    assert raw["train"]["text"] == expected
    _, validation = build_lm_datasets(raw, tokenizer, "text", BLOCK)
    assert stream_of(validation) == [token for document in expected if document for token in  # (empty: none)
                                     tokenizer(document, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                                     ][:len(validation) * BLOCK]


def test_one_text_file_gives_up_the_end_of_its_lines_for_validation(plays) -> None:
    path = plays / "plays" / "act1.txt"
    raw = load_raw_datasets(None, None, str(path), None, 10, seed=0)
    lines = path.read_text().splitlines(keepends=True)
    cut = round(len(lines) * 0.9)
    assert raw["train"]["text"] == ["".join(lines[:cut])] and raw["validation"]["text"] == ["".join(lines[cut:])]


@pytest.mark.parts("streaming")
def test_a_stream_reads_text_files_as_train_py_does(plays) -> None:
    from parts.streaming.documents import document_streams

    for reading in (TextReading(), TextReading("paragraph")):
        files = str(plays / "plays" / "*.txt"), str(plays / "validation.txt")
        streamed = document_streams(None, None, *files, "text", False, reading)
        loaded = load_raw_datasets(None, None, *files, 5, seed=0, text=reading)
        for split in ("train", "validation"):
            assert [row["text"] for row in streamed[split]] == loaded[split]["text"]


@pytest.mark.parts("pretokenized")
def test_prepared_shards_read_text_files_as_train_py_does(plays, tokenizer, tmp_path) -> None:
    from datasets import load_from_disk

    from scripts.prepare_data import parse_args as prepare_args
    from scripts.prepare_data import prepare

    files = ("--train_file", str(plays / "plays" / "*.txt"), "--validation_file", str(plays / "validation.txt"))
    args = prepare_args([*files, "--block_size", str(BLOCK), "--output_dir", str(tmp_path / "shards")])
    assert (args.sample_by, args.keep_linebreaks) == ("document", True)  # train.py's defaults
    prepare(args)
    raw = load_raw_datasets(None, None, *files[1::2], 5, seed=0)
    expected, _ = build_lm_datasets(raw, tokenizer, "text", BLOCK)
    assert stream_of(load_from_disk(str(tmp_path / "shards" / "train")).with_format("torch")) == stream_of(expected)


def test_the_long_sequence_warning_is_shown_only_where_text_is_cut_and_not_trained_on(tokenizer, capfd, caplog,
                                                                                      monkeypatch) -> None:
    """Packed, a document longer than the model's maximum is cut into blocks that all train: transformers' warning
    ("will result in indexing errors") only alarmed. Unpacked, a document longer than the block loses its rest."""
    document = " ".join(random.Random(0).choice(["once", "upon", "a", "time"]) for _ in range(3000))
    monkeypatch.setattr(data.packing, "warned_of_cuts", False)
    tokenize_and_pack({"text": [document]}, tokenizer, "text", BLOCK)
    assert LONG_WARNING not in capfd.readouterr().err
    with caplog.at_level(logging.WARNING, logger="data.packing"):
        tokenize_and_pack({"text": [document]}, tokenizer, "text", BLOCK)
        assert not caplog.records
        tokenize_documents({"text": ["once upon a time", document]}, tokenizer, "text", BLOCK)
    assert [record.getMessage().split(":")[0] for record in caplog.records] == [
        f"a document of {len(tokenizer(document)['input_ids']) + 1:,} tokens is longer than --block_size {BLOCK}"]
