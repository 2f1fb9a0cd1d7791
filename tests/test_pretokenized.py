"""Pre-tokenised shards (parts/pretokenized/, scripts/prepare_data.py, --dataset_path): two processes train from
them as prepared (two machines: tests/test_multinode.py), another tokenizer or block size is refused, and so are
raw data beside them."""

from __future__ import annotations

import json

import pytest

from data import DataError
from models.language import build_tokenizer
from parts.pretokenized.shards import load_shards
from tests.fixtures.pretokenized import shards_run_args
from tests.harness import TINY_RUN, flag_refusal

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


def test_prepared_shards_train_on_two_processes_and_refuse_another_tokenizer_or_block_size(prepared_shards,
                                                                                          cached_run) -> None:
    """Two processes train from the shards as prepared (two machines: tests/test_multinode.py)."""
    manifest = json.loads((prepared_shards / "manifest.json").read_text())
    assert manifest["block_size"] == 64 and manifest["splits"]["train"] > 100
    log = (cached_run("ddp", *shards_run_args(prepared_shards)) / "launch.log").read_text()
    assert f"{manifest['splits']['train'] // 8 * 8} sequences of up to 64 tokens" in log  # whole global batches
    assert "Tokenizing" not in log  # read as prepared
    tokenizer = build_tokenizer(None, None)
    other = build_tokenizer(None, None)
    other.add_tokens(["<an added token>"])  # the same vocabulary plus one: other ids
    for kind, (tokenizer_used, block_size) in {"tokenizer": (other, 64), "block size": (tokenizer, 32)}.items():
        with pytest.raises(DataError) as refused:
            load_shards(str(prepared_shards), tokenizer_used, block_size, packing=True)
        assert ("not this run's tokenizer" if kind == "tokenizer" else "holds sequences of block size 64") in str(refused.value)


@pytest.mark.quick
def test_shards_and_raw_data_are_one_line(monkeypatch, tmp_path) -> None:
    args = [*TINY_RUN, "--output_dir", str(tmp_path), "--dataset_path", "x", "--train_file", "y.jsonl"]
    assert "drop --dataset_name/--train_file" in flag_refusal(args, {}, monkeypatch)
