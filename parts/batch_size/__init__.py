"""`--auto_find_batch_size`: the largest per-device micro-batch that fits, found before the first step, with the
global batch (and so every step's loss) kept: `search.py`. A resumed run takes the size its checkpoint recorded.
docs/batch_size.md.
"""

from dataclasses import dataclass, field

from training.errors import ArgumentError
from training.parts import Conflict, Flags, MicroBatchSearch, Part, Prepared, Started


@dataclass
class BatchSizeFlags:
    auto_find_batch_size: bool = field(
        default=False, metadata={"help": "If a micro-step of --per_device_train_batch_size runs out of memory before "
                                 "training, halve it and double --gradient_accumulation_steps until one fits (the global "
                                 "batch, and so the results, stay the same); every rank agrees. DDP and FSDP2."})


class BatchSize(Part):
    name = "batch_size"
    description = "the largest micro-batch that fits, the global batch kept (--auto_find_batch_size)"
    flags = BatchSizeFlags
    conflicts = (Conflict("auto_find_batch_size", "streaming", "; set --per_device_train_batch_size yourself"),)

    def check_flags(self, flags: Flags) -> None:
        """The search resizes the micro-batch of data-parallel training over a dataset of known examples."""
        if not flags.train.parts.batch_size.auto_find_batch_size:
            return
        from training.arguments import split_model  # not at import: training/flags.py imports the parts

        if split := split_model(flags):
            raise ArgumentError(f"--auto_find_batch_size with {split} is not supported; set "
                                "--per_device_train_batch_size yourself")

    def resuming(self, run: Started) -> None:
        """A resumed run takes the micro-batch its checkpoint's run found, instead of searching again."""
        if run.args.parts.batch_size.auto_find_batch_size:
            from parts.batch_size.search import take_recorded_micro_batch

            take_recorded_micro_batch(run.accelerator, run.args, run.resume)

    def micro_batch(self, prepared: Prepared, search: MicroBatchSearch) -> Prepared:
        """`prepared` for the micro-batch that fits (a resumed run already took its recorded one)."""
        if not search.args.parts.batch_size.auto_find_batch_size or search.resumed:
            return prepared
        from parts.batch_size.search import fit_micro_batch

        return fit_micro_batch(search.accelerator, search.task, search.objective, search.train_set, search.args,
                               search.prepare_training, search.loader_for, prepared)


PART = BatchSize()
