"""Rebuild the shipped tokenizer (`models/tokenizer/`) from the embedded default corpus.

A byte-level BPE, so any text can be encoded even though it was trained on the
default stories. Training is deterministic: running this again gives the same files
(a test checks that).

    python scripts/build_tokenizer.py [--output_dir models/tokenizer]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data.default_corpus import default_splits  # noqa: E402

VOCAB_SIZE = 1024
EOS = "<|endoftext|>"
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "models" / "tokenizer"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the BPE on the default training split and wrap it for `transformers`."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(default_splits()["train"], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=EOS, eos_token=EOS, pad_token=EOS, model_max_length=2048
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    build_tokenizer().save_pretrained(args.output_dir)
    print(f"tokenizer written to {args.output_dir}")


if __name__ == "__main__":
    main()
