"""Streaming text (`--streaming`): documents read from their files as training needs them, tokenised and
packed on the fly, each rank its own share, its position saved in every checkpoint. docs/streaming.md.

`documents.py` turns data files into streams, one shard per file (bad files named or skipped);
`loader.py` gives each rank its share, shuffles it and saves its position. Nothing here imports torch at
import time: `train.py --help` lists the flags before it loads.
"""

from dataclasses import dataclass, field, fields

from training.errors import ArgumentError
from training.parts import CheckpointFiles, Flags, Loading, Part, TextSource


@dataclass
class StreamingFlags:
    streaming: bool = field(default=False, metadata={"help": "Read the training data as a stream, tokenised and packed on "
                            "the fly, each rank its own share; needs --max_steps. See docs/streaming.md."})
    shuffle_buffer_size: int = field(default=1000, metadata={"help": "--streaming: sequences each rank shuffles among "
                                                                     "(reseeded every epoch); 0: none."})
    skip_bad_shards: bool = field(default=False, metadata={"help": "--streaming: skip a data file that cannot be read or "
                                                                   "is empty (logged, counted) instead of stopping."})


class StreamSource(TextSource):
    """The documents as streams: the training stream and the first --max_eval_samples validation sequences."""

    flag = "--streaming"

    def __init__(self, data_args) -> None:
        self.data_args = data_args

    def load(self, seed: int):
        from data import TextReading
        from parts.streaming.documents import document_streams

        d, self.seed = self.data_args, seed  # the shard order and the shuffle buffer draw from the seed
        return document_streams(d.dataset_name, d.dataset_config_name, d.train_file, d.validation_file, d.text_column,
                                d.parts.streaming.skip_bad_shards, TextReading(d.sample_by, d.keep_linebreaks))

    def datasets(self, raw, tokenizer, block_size: int, main_process_first) -> tuple:
        from parts.streaming.documents import stream_datasets

        d = self.data_args
        return stream_datasets(raw, tokenizer, d.text_column, block_size, d.packing, self.seed, d.max_eval_samples)


class Streaming(Part):
    name = "streaming"
    description = "text read as streams, each rank its share, its position in checkpoints (--streaming)"
    flags = StreamingFlags
    task_flags = {"causal-lm": tuple(f.name for f in fields(StreamingFlags))}
    files = ("tests/probes/stream_probe.py",)
    requirements = ("torchdata",)
    # a stream's saved position is a count of what each rank read of its share: of these very files, in this order
    fixed_on_resume = {"streaming": "a stream resumes from its saved position, which a map-style epoch cannot take "
                                    "over, nor a stream one's",
                       "shuffle_buffer_size": "the saved position counts sequences drawn through this buffer"}

    def __init__(self) -> None:
        self.loader = None  # this rank's share of the training stream: its position goes into checkpoints

    def check_flags(self, flags: Flags) -> None:
        """A stream has no length and no random access: what needs either is refused before any process group
        starts."""
        data_args, args = flags.data, flags.train
        from training.arguments import flags_given, split_model  # not at import: training/flags.py imports the parts

        if not data_args.parts.streaming.streaming:
            if given := flags_given(data_args, [option.name for option in fields(StreamingFlags)[1:]]):
                raise ArgumentError(f"--{given[0]} is for --streaming: add --streaming, or drop it")
            return

        # a split model: the ranks of one replica would need the same share
        refusals = {"--max_train_samples (use --max_steps)": data_args.max_train_samples,
                    (split := split_model(flags)): split}
        if refused := [name for name, value in refusals.items() if value]:
            raise ArgumentError(f"--streaming with {refused[0]} is not supported")
        if args.max_steps < 1:
            raise ArgumentError("--streaming needs --max_steps: a stream's length is not known before it ends")
        if "epoch" in (args.eval_strategy, args.save_strategy):
            raise ArgumentError("--eval_strategy/--save_strategy epoch need an epoch's length, which a stream does not "
                                "know: use steps with --streaming")
        if args.eval_strategy != "no" and data_args.max_eval_samples is None:
            raise ArgumentError("--streaming evaluates a bounded set: add --max_eval_samples N (the first N sequences "
                                "of the validation stream), or --eval_strategy no")
        if data_args.parts.streaming.shuffle_buffer_size < 0:
            raise ArgumentError(f"--shuffle_buffer_size must be >= 0 (0: no shuffling), got "
                                f"{data_args.parts.streaming.shuffle_buffer_size}")

    def text_source(self, data) -> TextSource | None:
        return StreamSource(data) if data.parts.streaming.streaming else None

    def train_loader(self, loading: Loading):
        """This rank's share of the training stream, batched, its position in every checkpoint."""
        from datasets import IterableDataset

        if not isinstance(loading.train_set, IterableDataset):
            return None
        from parts.streaming.loader import StreamLoader

        args = loading.args
        self.loader = StreamLoader(loading.accelerator, loading.train_set, args.per_device_train_batch_size,
                                   loading.settings, args.seed, loading.task.data_args.parts.streaming.shuffle_buffer_size,
                                   args.ddp_timeout)
        return self.loader

    def save_state(self, checkpoint: CheckpointFiles) -> None:
        if self.loader is not None:
            self.loader.save(checkpoint.directory)

    def load_state(self, checkpoint: CheckpointFiles) -> None:
        if self.loader is not None:
            self.loader.load(checkpoint.directory)


PART = Streaming()
