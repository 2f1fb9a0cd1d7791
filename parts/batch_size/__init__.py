"""`--auto_find_batch_size`: the largest per-device micro-batch that fits, found before the first step, with the
global batch (and so every step's loss) kept: `search.py`. A resumed run takes the size its checkpoint recorded.
docs/batch_size.md.
"""

from dataclasses import dataclass, field

from training.errors import ArgumentError
from training.parts import Part


@dataclass
class BatchSizeFlags:
    auto_find_batch_size: bool = field(
        default=False, metadata={"help": "If a micro-step of --per_device_train_batch_size runs out of memory before "
                                 "training, halve it and double --gradient_accumulation_steps until one fits (the global "
                                 "batch, and so the results, stay the same); every rank agrees. DDP and FSDP2."})


def check_flags(model_args, data_args, args) -> None:
    """The search resizes the micro-batch of data-parallel training over a dataset of known examples."""
    if not args.auto_find_batch_size:
        return
    from training.arguments import split_model  # not at import: training/flags.py imports the parts

    if split := split_model(model_args, args) or ("--streaming" if getattr(data_args, "streaming", False) else None):
        raise ArgumentError(f"--auto_find_batch_size with {split} is not supported; set --per_device_train_batch_size "
                            "yourself")


def resuming(accelerator, args, checkpoint) -> None:
    """The micro-batch the checkpoint's run found, instead of searching again."""
    if args.auto_find_batch_size:
        from parts.batch_size.search import take_recorded_micro_batch

        take_recorded_micro_batch(accelerator, args, checkpoint)


def micro_batch(prepared, accelerator, task, objective, train_set, args, prepare_training, loader_for, resumed):
    """`prepared` for the micro-batch that fits (a resumed run already took its recorded one)."""
    if not args.auto_find_batch_size or resumed:
        return prepared
    from parts.batch_size.search import fit_micro_batch

    return fit_micro_batch(accelerator, task, objective, train_set, args, prepare_training, loader_for, prepared)


PART = Part("batch_size", "the largest micro-batch that fits, the global batch kept (--auto_find_batch_size)",
            BatchSizeFlags, check_flags=check_flags, resuming=resuming, micro_batch=micro_batch)
