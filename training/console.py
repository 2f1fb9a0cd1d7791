"""What the console shows: log lines from the main process, one progress bar, and no
third-party noise that a user cannot act on. Errors still come from every rank."""

from __future__ import annotations

import logging
import os
import warnings

import datasets
import torch
import transformers


def quiet_third_party_output() -> None:
    """Before anything imports DeepSpeed or builds the Accelerator: the same on every rank."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates, once per step: not actionable here.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # accelerate 1.15 passes DDP only `broadcast_buffers` (off on purpose: training/batchnorm.py), which torch 2.13 renames.
    warnings.filterwarnings("ignore", message=r"`broadcast_buffers` is deprecated", category=FutureWarning)
    if not torch.accelerator.is_available():  # else DeepSpeed warns on every rank that it uses the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("accelerate.accelerator").setLevel(logging.WARNING)  # notes on how it filled DeepSpeed's "auto"s
    logging.getLogger("accelerate.checkpointing").setLevel(logging.WARNING)  # a line per file saved; train.py says one


def one_voice(is_main_process: bool) -> None:
    """Once the ranks are known, only the main process reports progress (downloads, data preparation) and info."""
    if not is_main_process:
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def only_the_training_bar() -> None:
    """From the first step on, the training bar is the only one (the export's load and save bars would interleave)."""
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
