"""`--task image-classification`: one label per image (the `Task` contract: training/tasks.py)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict
from transformers import AutoImageProcessor, AutoModelForImageClassification, PreTrainedModel

from parts.images.data import build_image_datasets, class_names, load_raw_image_datasets, pixel_values
from parts.images.models import build_image_model, build_image_processor
from training.loss import class_loss_sums
from training.strategy import Strategy, wrapped_strategy
from training.tasks import Batch, Task


class ImageClassification(Task):
    """One label per image; targets are images."""

    auto_model = AutoModelForImageClassification
    model_input = "pixel_values"
    # (built whole on every rank: small models, and accelerate broadcasts parameters only, not BatchNorm's statistics)
    SAMPLE_IMAGES = 8

    def __init__(self, model_args, data_args) -> None:
        super().__init__(model_args, data_args)
        self.processor = build_image_processor(model_args.model_name_or_path, model_args.model_config, data_args.parts.images.image_size)
        self.labels: list[str] = []  # the class names; set by build_model
        self.raw_validation: Dataset | None = None  # for the sample at the end; set by build_model

    def load_raw_datasets(self, seed: int) -> DatasetDict:
        d = self.data_args
        return load_raw_image_datasets(d.dataset_name, d.dataset_config_name, d.parts.images.train_dir, d.parts.images.validation_dir,
                                       d.validation_split_percentage, seed, d.parts.images.image_column, d.parts.images.label_column)

    def build_model(self, raw: DatasetDict, empty: bool = False) -> PreTrainedModel:
        m, d = self.model_args, self.data_args
        self.model_name = m.model_name_or_path or m.model_config
        self.labels, self.raw_validation = class_names(raw, d.parts.images.label_column), raw["validation"]
        model = build_image_model(m.model_name_or_path, m.model_config, self.labels, m.trust_remote_code,
                                  m.gradient_checkpointing, d.parts.images.ignore_mismatched_sizes)
        example = pixel_values(self.processor, [raw["train"][0][d.parts.images.image_column]])[0]
        self.flops_per_unit = counted_flops_per_example(model, example, "pixel_values")
        self.settings = {"image_size": example.shape[-1], "num_labels": len(self.labels)}
        # every batch one shape: cuDNN's autotuner picks the fastest convolutions once (GPUs; no effect on CPU)
        torch.backends.cudnn.benchmark = True
        return model

    def build_datasets(self, raw: DatasetDict, main_process_first: AbstractContextManager) -> tuple[Dataset, Dataset]:
        return build_image_datasets(raw, self.processor, self.data_args.parts.images.image_column, self.data_args.parts.images.label_column)

    def forward(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return model(pixel_values=batch["pixel_values"].to(floating_input_dtype(model))).logits

    def loss_sums(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return class_loss_sums(logits, batch["labels"])

    def correct(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return (logits.argmax(dim=-1) == batch["labels"]).long()

    def count_targets(self, batch: Batch) -> torch.Tensor:
        # a fill on the device, not a copy from the host per micro-batch
        return torch.full((), batch["labels"].numel(), device=batch["labels"].device)

    def count_units(self, batch: Batch) -> int:
        return batch["labels"].numel()

    def describe_data(self, train_set: Dataset) -> str:
        return f"{len(train_set)} images of {len(self.labels)} classes at {self.settings['image_size']} px"

    def sample(self, final_dir: Path) -> str:
        model = AutoModelForImageClassification.from_pretrained(final_dir).eval()
        processor = AutoImageProcessor.from_pretrained(final_dir, backend="pil")
        examples = self.raw_validation.select(range(min(self.SAMPLE_IMAGES, len(self.raw_validation))))
        with torch.no_grad():
            inputs = pixel_values(processor, examples[self.data_args.parts.images.image_column]).to(model.dtype)  # bf16 under DeepSpeed
            predicted = model(pixel_values=inputs).logits
        pairs = [(model.config.id2label[p], self.labels[t])
                 for p, t in zip(predicted.argmax(dim=-1).tolist(), examples[self.data_args.parts.images.label_column])]
        right = sum(p == t for p, t in pairs)
        return f"{right}/{len(pairs)} validation images right: " + ", ".join(f"{p} ({t})" if p != t else p for p, t in pairs)


def floating_input_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype for floating-point inputs (pixels): DeepSpeed's bf16/fp16 engines hold the whole
    model in that dtype and do not autocast, so inputs must match (as Trainer casts them); every
    other strategy autocasts from fp32."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED and (model.bfloat16_enabled() or model.fp16_enabled()):
        return torch.bfloat16 if model.bfloat16_enabled() else torch.float16
    return torch.float32


def counted_flops_per_example(model: torch.nn.Module, example: torch.Tensor, input_name: str) -> float:
    """Training FLOPs (forward and backward) per example, counted by torch on a meta-device copy
    of the model (no memory, no compute): for models with no closed formula, such as CNNs.

    Two examples: BatchNorm refuses to train on a batch of one.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        meta_model = type(model)(model.config)
    with FlopCounterMode(display=False) as counter:
        meta_model(**{input_name: torch.zeros(2, *example.shape, device="meta")}).logits.sum().backward()
    return counter.get_total_flops() / 2
