"""Image classifiers and their image processors (`--task image-classification`).

Two ways in, as for language models:
- `--model_name_or_path`: a Hub id or local directory holding any
  `AutoModelForImageClassification` (fine-tuning; `--ignore_mismatched_sizes` replaces a
  classification head trained for other labels);
- `--model_config NAME`: a named ResNet from `configs.py`, trained from scratch.
"""

from __future__ import annotations

import torch
from transformers import AutoImageProcessor, AutoModelForImageClassification, PreTrainedModel
from transformers.image_processing_utils import BaseImageProcessor
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

from parts.images.configs import IMAGE_CONFIGS, build_image_config, label_maps
from models.language import ModelError, enable_gradient_checkpointing, loading


def build_image_processor(model_name_or_path: str | None, model_config: str, image_size: int | None) -> BaseImageProcessor:
    """The pretrained model's own processor (its sizes: what it was trained at), or a
    resize-and-normalise one for a named config, at `image_size` or the config's size.

    The PIL backend always: the same pixels with or without torchvision installed.
    """
    if model_name_or_path:
        with loading("image processor", model_name_or_path):
            return AutoImageProcessor.from_pretrained(model_name_or_path, backend="pil")
    size = image_size or IMAGE_CONFIGS[model_config].image_size
    return ViTImageProcessorPil(
        size={"height": size, "width": size}, image_mean=IMAGENET_DEFAULT_MEAN, image_std=IMAGENET_DEFAULT_STD
    )


def build_image_model(
    model_name_or_path: str | None,
    model_config: str,
    labels: list[str],
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    ignore_mismatched_sizes: bool = False,
) -> PreTrainedModel:
    """Load a pretrained classifier with a head for `labels`, or initialise a named config (seed first); fp32."""
    if model_name_or_path:
        try:
            with loading("model", model_name_or_path):
                model = AutoModelForImageClassification.from_pretrained(
                    model_name_or_path, num_labels=len(labels), **label_maps(labels), dtype=torch.float32,
                    trust_remote_code=trust_remote_code, ignore_mismatched_sizes=ignore_mismatched_sizes,
                )
        except RuntimeError as error:  # transformers' loading report: the head's shape differs
            if "ignore_mismatched_sizes" not in str(error):
                raise
            raise ModelError(
                f"{model_name_or_path} has a classification head for other labels than your {len(labels)}; pass "
                "--ignore_mismatched_sizes to start a new head for yours"
            ) from None
    else:
        model = AutoModelForImageClassification.from_config(build_image_config(model_config, labels), dtype=torch.float32)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model
