"""Train a byte-level BPE tokenizer: the shipped one (`models/tokenizer/`, from the embedded
default corpus), or one for your own corpus (`--train_file`).

Byte-level, so any text can be encoded. Training is deterministic: running this again gives
the same files (a test checks that for the shipped tokenizer).

    python scripts/build_tokenizer.py                                   # rebuild models/tokenizer
    python scripts/build_tokenizer.py --train_file my_corpus.jsonl --output_dir my_tokenizer --vocab_size 8192
    accelerate launch train.py --train_file my_corpus.jsonl --tokenizer_name my_tokenizer

A `--model_config` model sizes its vocabulary to the tokenizer it trains with. Every tokenizer
built here also has ChatML's two turn markers (added after training: the learned ids do not
move) and a chat template, for `--task sft`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data import FILE_BUILDERS, check_data_file  # noqa: E402
from data.default_corpus import default_splits  # noqa: E402

VOCAB_SIZE = 1024
EOS = "<|endoftext|>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"  # ChatML's turn markers, one token each
# ChatML, as many Hub models use it. Without `{% generation %}` markers, like most Hub
# templates: train.py finds the answers by rendering prefixes (parts/sft/chat.py).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "models" / "tokenizer"


def build_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the BPE on `texts` and wrap it for `transformers`."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.add_special_tokens([TURN_START, TURN_END])  # after training: the ids of every other token stay
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=EOS, eos_token=EOS, pad_token=EOS, model_max_length=2048
    )
    tokenizer.chat_template = CHAT_TEMPLATE  # --task sft formats conversations with it
    return tokenizer


def corpus_texts(train_file: str, text_column: str) -> list[str]:
    """The documents of a txt, json/jsonl, csv or parquet file (the formats train.py reads)."""
    from datasets import load_dataset

    dataset = load_dataset(check_data_file(train_file), data_files=train_file, split="train")
    if text_column not in dataset.column_names:
        raise ValueError(f"{train_file} has no column {text_column!r} (columns: {dataset.column_names}); "
                         "pass --text_column")
    return [text for text in dataset[text_column] if text]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train_file", help=f"your corpus ({', '.join(sorted(FILE_BUILDERS))}); "
                                             "default: the shipped tokenizer's corpus")
    parser.add_argument("--text_column", default="text", help="the column that holds the documents (not for .txt)")
    parser.add_argument("--vocab_size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--output_dir", type=Path, default=None, help="default: models/tokenizer without --train_file")
    args = parser.parse_args()
    if args.train_file and args.output_dir is None:
        parser.error("--train_file needs --output_dir (models/tokenizer holds the shipped tokenizer)")
    try:
        texts = corpus_texts(args.train_file, args.text_column) if args.train_file else default_splits()["train"]
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    output_dir = args.output_dir or DEFAULT_OUTPUT
    build_tokenizer(texts, args.vocab_size).save_pretrained(output_dir)
    print(f"tokenizer written to {output_dir} ({args.vocab_size} tokens, from {args.train_file or 'the default corpus'})")


if __name__ == "__main__":
    main()
