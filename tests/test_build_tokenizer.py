"""scripts/build_tokenizer.py (parts/build_tokenizer): it rebuilds the shipped tokenizer to the byte, and trains one on
a user's corpus that a named config sizes its vocabulary to."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from models.configs import build_named_config
from models.language import SHIPPED_TOKENIZER
from tests.harness import REPO

pytestmark = pytest.mark.quick  # every test here: the quick tier (pytest -m quick)


def test_the_shipped_tokenizer_is_what_the_build_script_makes(tmp_path) -> None:
    subprocess.run([sys.executable, "scripts/build_tokenizer.py", "--output_dir", str(tmp_path)], cwd=REPO, check=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_text() == (SHIPPED_TOKENIZER / name).read_text(), name


def test_a_tokenizer_of_the_users_corpus_sizes_a_named_config(uneven_data, tmp_path) -> None:
    corpus = uneven_data[uneven_data.index("--train_file") + 1]
    built = subprocess.run([sys.executable, "scripts/build_tokenizer.py", "--train_file", corpus, "--vocab_size", "300",
                            "--output_dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 302 and tokenizer.chat_template  # 300 learned, and the two chat turn markers (--task sft)
    assert build_named_config("llama-tiny", tokenizer).vocab_size == 320  # 302, padded to a multiple of 64
    text = "The fox, 12 + 7 = 19. café ✓"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: any text
