"""Datasets for image classification (`--task image-classification`).

Sources, in order of precedence:
- `--dataset_name` (+ `--dataset_config_name`): an image dataset on the Hugging Face Hub,
  or a local dataset directory that `datasets.load_dataset` understands;
- `--train_dir` (+ `--validation_dir`): local folders in the `imagefolder` layout, one
  sub-folder per class (`train_dir/cat/001.jpg`, `train_dir/dog/002.png`, ...);
- nothing: the embedded default shapes (`default_shapes.py`).

Images are decoded and turned into `pixel_values` by the model's image processor when a
batch is read (no augmentation: add it in `to_model_inputs` if your data needs it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import ClassLabel, Dataset, DatasetDict, load_dataset
from transformers.image_processing_utils import BaseImageProcessor

from data import DataError, hold_out
from parts.images.default_shapes import default_shape_splits


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
    splits = {name: raw[name] for name in ("train", "validation") if name in raw}  # other splits are never read
    for name, split in splits.items():
        for column, flag in ((image_column, "--image_column"), (label_column, "--label_column")):
            if column not in split.column_names:
                raise DataError(f"column {column!r} not found in the {name} split (columns: {split.column_names}); set {flag}")
    train = _as_class_labels(splits["train"], label_column)
    if "validation" in splits:
        return DatasetDict({"train": train, "validation": _same_classes(splits["validation"], train, label_column)})
    return hold_out(train, validation_split_percentage, seed, stratify_by_column=label_column)


def _as_class_labels(dataset: Dataset, label_column: str) -> Dataset:
    """Labels as a `ClassLabel`: integers keep their ids, strings are numbered in sorted order."""
    feature = dataset.features[label_column]
    if isinstance(feature, ClassLabel):
        return dataset
    if feature.dtype.startswith("int"):
        return dataset.cast_column(label_column, ClassLabel(num_classes=max(dataset[label_column]) + 1))
    return dataset.class_encode_column(label_column)


def _same_classes(validation: Dataset, train: Dataset, label_column: str) -> Dataset:
    """The validation labels numbered as train's; other class names are an error."""
    classes, feature = train.features[label_column], validation.features[label_column]
    if isinstance(feature, ClassLabel):
        if feature.names != classes.names:
            raise DataError(f"the validation classes {feature.names} differ from train's {classes.names}; "
                            "give both splits the same class folders")
        return validation
    if not feature.dtype.startswith("int") and (unknown := set(validation.unique(label_column)) - set(classes.names)):
        raise DataError(f"validation labels {sorted(unknown)} are not among the training classes {classes.names}")
    return validation.cast_column(label_column, classes)


def class_names(raw: DatasetDict, label_column: str) -> list[str]:
    """The labels' names, in label-id order."""
    return raw["train"].features[label_column].names


def pixel_values(processor: BaseImageProcessor, images: list) -> torch.Tensor:
    """A batch of images (any PIL mode) as the model's input tensor."""
    return processor([image.convert("RGB") for image in images], return_tensors="pt")["pixel_values"]


def build_image_datasets(
    raw: DatasetDict, processor: BaseImageProcessor, image_column: str, label_column: str
) -> tuple[Dataset, Dataset]:
    """Both splits as datasets of `pixel_values` and `labels`, made from the images as batches are read."""

    def to_model_inputs(batch: dict[str, list]) -> dict[str, torch.Tensor]:
        return {"pixel_values": pixel_values(processor, batch[image_column]), "labels": torch.tensor(batch[label_column])}

    return raw["train"].with_transform(to_model_inputs), raw["validation"].with_transform(to_model_inputs)
