"""Recipe (b): your own data for the causal LM, a folder of `.npy` token arrays.

    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py --task recipes.npy_tokens:NpyTokens \
        --dataset_name my_tokens/

`my_tokens/train/*.npy` and `my_tokens/validation/*.npy`: 1-D arrays of token ids of the tokenizer the run uses
(the shipped one unless --tokenizer_name), however you tokenised them. Each split's files are read in name order,
concatenated, and cut into blocks of --block_size tokens (the model's length by default); the last partial
block is left out. A plain `torch.utils.data.Dataset`: no `datasets` involved.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from training.tasks import CausalLM


class TokenBlocks(Dataset):
    """Fixed blocks of a token stream: the model predicts each block's next tokens (its labels are its ids)."""

    def __init__(self, arrays: list[np.ndarray], block_size: int) -> None:
        stream = torch.from_numpy(np.concatenate(arrays).astype(np.int64))
        self.blocks = stream[: len(stream) // block_size * block_size].view(-1, block_size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


class NpyTokens(CausalLM):
    """The causal-LM task, reading its data from the folder --dataset_name names."""

    def load_raw_datasets(self, seed: int) -> dict[str, list[np.ndarray]]:
        folder = Path(self.data_args.dataset_name)
        files = {split: sorted((folder / split).glob("*.npy")) for split in ("train", "validation")}
        if missing := [split for split, found in files.items() if not found]:
            raise FileNotFoundError(f"no .npy files in {', '.join(str(folder / split) for split in missing)}: "
                                    "--dataset_name names a folder holding train/ and validation/ .npy token arrays")
        return {split: [np.load(file) for file in found] for split, found in files.items()}

    def build_datasets(self, raw: dict[str, list[np.ndarray]], main_process_first) -> tuple[Dataset, Dataset]:
        return TokenBlocks(raw["train"], self.block_size), TokenBlocks(raw["validation"], self.block_size)

    def describe_data(self, train_set: Dataset) -> str:
        return f"{len(train_set)} blocks of {self.block_size} tokens from .npy files"
