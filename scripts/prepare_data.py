"""Tokenise and pack a corpus once, into memory-mapped shards that every rank and node trains from.

    python scripts/prepare_data.py --train_file corpus.jsonl --block_size 256 --num_proc 8 --output_dir data/corpus-256
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --dataset_path data/corpus-256

The same data flags as train.py (`--dataset_name`, `--train_file`, `--validation_file`, `--text_column`,
`--sample_by`, `--keep_linebreaks`, `--packing`; no flags: the embedded corpus) and tokenizer (`--tokenizer_name`,
else `--model_name_or_path`'s, else the shipped one). The format, `datasets`' Arrow shards plus `manifest.json` with the tokenizer's
fingerprint and the block size, is described in parts/pretokenized/shards.py; train.py refuses shards made for
another tokenizer or block size. Prints the tokens written and the throughput; `--json` saves them.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import tempfile
import time
from pathlib import Path

import datasets

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data import DataError, TextReading, build_lm_datasets, load_raw_datasets  # noqa: E402
from parts.pretokenized.shards import MANIFEST, write_shards  # noqa: E402
from models.language import ModelError, build_tokenizer  # noqa: E402
from training.flags import SAMPLE_BY  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True, help="where the shards and manifest.json go (new or empty)")
    parser.add_argument("--block_size", type=int, required=True, help="tokens per sequence; train.py must use the same")
    parser.add_argument("--num_proc", type=int, default=1, help="tokenising processes")
    parser.add_argument("--num_shards", type=int, default=None, help="Arrow files per split (default: one per process)")
    parser.add_argument("--dataset_name")
    parser.add_argument("--dataset_config_name")
    parser.add_argument("--train_file")
    parser.add_argument("--validation_file")
    parser.add_argument("--validation_split_percentage", type=int, default=5)
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--sample_by", default="document", choices=SAMPLE_BY,
                        help="what one document of a .txt file is, as train.py's flag")
    parser.add_argument("--keep_linebreaks", type=lambda value: value.lower() in ("1", "true", "yes"), default=True,
                        help="--sample_by line: each line keeps its line break, as train.py's flag")
    parser.add_argument("--packing", type=lambda value: value.lower() in ("1", "true", "yes"), default=True)
    parser.add_argument("--tokenizer_name")
    parser.add_argument("--model_name_or_path")
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument("--seed", type=int, default=42, help="the held-out validation split's draw, as train.py's")
    parser.add_argument("--json", help="write the figures here as JSON")
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace) -> dict:
    """Tokenise (never from a cache: the figures are this run's), write the shards, return the figures. Needs free
    space for the shards twice, beside --output_dir, while it runs."""
    output = Path(args.output_dir)
    if output.exists() and any(output.iterdir()):
        raise DataError(f"--output_dir {output} is not empty; choose a new directory (shards are never overwritten)")
    tokenizer = build_tokenizer(args.model_name_or_path, args.tokenizer_name, args.trust_remote_code)
    raw = load_raw_datasets(args.dataset_name, args.dataset_config_name, args.train_file, args.validation_file,
                            args.validation_split_percentage, args.seed, TextReading(args.sample_by, args.keep_linebreaks))
    output.parent.mkdir(parents=True, exist_ok=True)
    # The tokenised copy goes to a scratch cache beside the output, removed once the shards are written: never
    # one made before (datasets would also keep that one's process count).
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=".prepare-") as scratch:
        datasets.config.HF_DATASETS_CACHE = scratch
        start = time.perf_counter()
        train, validation = build_lm_datasets(raw, tokenizer, args.text_column, args.block_size, packing=args.packing,
                                              num_proc=args.num_proc if args.num_proc > 1 else None)
        tokenised_s = time.perf_counter() - start
        manifest = write_shards({"train": train, "validation": validation}, output, tokenizer,
                                args.tokenizer_name or args.model_name_or_path or "the shipped tokenizer", args.block_size,
                                args.packing, args.dataset_name or args.train_file or "the embedded corpus",
                                args.num_shards or args.num_proc)
    tokens = sum(manifest["tokens"].values())
    return {"manifest": manifest, "num_proc": args.num_proc, "tokens": tokens, "tokenise_seconds": tokenised_s,
            "total_seconds": time.perf_counter() - start, "tokens_per_sec": tokens / tokenised_s,
            "source_bytes": sum(Path(path).stat().st_size for pattern in (args.train_file, args.validation_file)
                                if pattern for path in glob.glob(pattern))}  # (a file, or a pattern of them)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        figures = prepare(args)
    except (DataError, ModelError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    splits = figures["manifest"]["splits"]
    print(f"wrote {splits['train']:,} training and {splits['validation']:,} validation sequences of "
          f"{args.block_size} tokens ({figures['tokens']:,} tokens) to {args.output_dir} ({MANIFEST} beside them)\n"
          f"tokenised with {args.num_proc} process(es) in {figures['tokenise_seconds']:.1f} s: "
          f"{figures['tokens_per_sec']:,.0f} tokens/s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
