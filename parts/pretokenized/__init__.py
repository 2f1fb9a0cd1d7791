"""Pre-tokenised shards (`--dataset_path`): a corpus tokenised and packed once by `scripts/prepare_data.py`,
memory-mapped by every rank of every node. `shards.py` holds the format and its checks. docs/pretokenized.md.
"""

from dataclasses import dataclass, field

from training.errors import ArgumentError
from training.parts import Flags, Part, TextSource


@dataclass
class PretokenizedFlags:
    dataset_path: str | None = field(default=None, metadata={"help": "Pre-tokenised shards from scripts/prepare_data.py."})


class ShardSource(TextSource):
    """The shards' training and validation splits, checked against this run's tokenizer and block size."""

    flag = "--dataset_path"

    def __init__(self, data_args) -> None:
        self.data_args = data_args

    def block_size(self) -> int:
        from parts.pretokenized.shards import read_manifest

        return read_manifest(self.data_args.parts.pretokenized.dataset_path)["block_size"]  # another --block_size: refused

    def load(self, seed: int):
        return None  # nothing to read before the model: the shards are memory-mapped by `datasets`

    def datasets(self, raw, tokenizer, block_size: int, main_process_first) -> tuple:
        from parts.pretokenized.shards import load_shards

        return load_shards(self.data_args.parts.pretokenized.dataset_path, tokenizer, block_size, self.data_args.packing)


class Pretokenized(Part):
    name = "pretokenized"
    description = "shards tokenised once by scripts/prepare_data.py, memory-mapped by every rank (--dataset_path)"
    flags = PretokenizedFlags
    task_flags = {"causal-lm": ("dataset_path",)}
    run_inputs = ("dataset_path",)
    files = ("scripts/prepare_data.py",)

    def check_flags(self, flags: Flags) -> None:
        data = flags.data
        if data.parts.pretokenized.dataset_path and (data.dataset_name or data.train_file):
            raise ArgumentError("--dataset_path trains on shards already tokenised: drop --dataset_name/--train_file")

    def text_source(self, data) -> TextSource | None:
        return ShardSource(data) if data.parts.pretokenized.dataset_path else None


PART = Pretokenized()
