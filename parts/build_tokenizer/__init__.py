"""A tokenizer trained on your own corpus: `scripts/build_tokenizer.py` trains a byte-level BPE from any file train.py
reads (and rebuilt the shipped one, `models/tokenizer/`, from the default corpus, to the byte). No hooks: training
reads the result through `--tokenizer_name`. docs/build_tokenizer.md."""

from training.parts import Part


class BuildTokenizer(Part):
    name = "build_tokenizer"
    description = "a byte-level BPE tokenizer trained on your own corpus (scripts/build_tokenizer.py)"
    files = ("scripts/build_tokenizer.py",)


PART = BuildTokenizer()
