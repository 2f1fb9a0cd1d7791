"""Datasets for image classification (`--task image-classification`).

Sources, in order of precedence:
- `--dataset_name` (+ `--dataset_config_name`): an image dataset on the Hugging Face Hub,
  or a local dataset directory that `datasets.load_dataset` understands;
- `--train_dir` (+ `--validation_dir`): local folders in the `imagefolder` layout, one
  sub-folder per class (`train_dir/cat/001.jpg`, `train_dir/dog/002.png`, ...);
- nothing: the embedded default shapes (`data/default_shapes.py`).

Images are decoded and turned into `pixel_values` by the model's image processor when a
batch is read (no augmentation: add it in `to_model_inputs` if your data needs it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import ClassLabel, Dataset, DatasetDict, load_dataset
from transformers.image_processing_utils import BaseImageProcessor

from data import DataError
from data.default_shapes import default_shape_splits


def load_raw_image_datasets(
    dataset_name: str | None,
    dataset_config_name: str | None,
    train_dir: str | None,
    validation_dir: str | None,
    validation_split_percentage: int,
    seed: int,
    image_column: str = "image",
    label_column: str = "label",
) -> DatasetDict:
    """A `DatasetDict` with `train` and `validation` splits of images and `ClassLabel` labels."""
    if dataset_name:
        raw = load_dataset(dataset_name, dataset_config_name)
    elif train_dir:
        folders = {"train": train_dir} | ({"validation": validation_dir} if validation_dir else {})
        for split, folder in folders.items():
            if not Path(folder).is_dir():
                raise DataError(f"--{split}_dir {folder} is not a directory; give a folder with one sub-folder per class")
        raw = load_dataset("imagefolder", data_files={split: str(Path(folder) / "**") for split, folder in folders.items()})
    else:
        raw = default_shape_splits()
    for name, split in raw.items():
        for column, flag in ((image_column, "--image_column"), (label_column, "--label_column")):
            if column not in split.column_names:
                raise DataError(f"column {column!r} not found in the {name} split (columns: {split.column_names}); set {flag}")
    if not isinstance(raw["train"].features[label_column], ClassLabel):  # e.g. strings in a csv-backed dataset
        raw = DatasetDict({name: split.class_encode_column(label_column) for name, split in raw.items()})
    if "validation" not in raw:  # the same share of every class held out
        split = raw["train"].train_test_split(
            test_size=validation_split_percentage / 100, seed=seed, stratify_by_column=label_column
        )
        raw = DatasetDict({"train": split["train"], "validation": split["test"]})
    if raw["validation"].features[label_column].names != class_names(raw, label_column):
        raise DataError(f"the validation classes differ from train's {class_names(raw, label_column)}; "
                        "give both splits the same class folders")
    return raw


def class_names(raw: DatasetDict, label_column: str) -> list[str]:
    """The labels' names, in label-id order."""
    return raw["train"].features[label_column].names


def build_image_datasets(
    raw: DatasetDict, processor: BaseImageProcessor, image_column: str, label_column: str
) -> tuple[Dataset, Dataset]:
    """Both splits as datasets of `pixel_values` and `labels`, made from the images as batches are read."""

    def to_model_inputs(batch: dict[str, list]) -> dict[str, torch.Tensor]:
        images = [image.convert("RGB") for image in batch[image_column]]
        return {"pixel_values": processor(images, return_tensors="pt")["pixel_values"],
                "labels": torch.tensor(batch[label_column])}

    return raw["train"].with_transform(to_model_inputs), raw["validation"].with_transform(to_model_inputs)
