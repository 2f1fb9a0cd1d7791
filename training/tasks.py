"""What is learned (`--task`): the model, its data and its loss. The training loop is the same for every task.

A task
- builds its processor (tokenizer or image processor), model and datasets, from `models/`
  and `data/`;
- runs the model on a batch (`forward`) and turns the logits into per-example loss sums and
  target counts (`loss_sums`), so a step's loss is the mean over the global batch's
  targets however the batch is split;
- counts right answers (`correct`) for `eval_accuracy`, and the units throughput is
  counted in (tokens, or samples);
- shows what the exported model does, loaded with plain `transformers`, at the end.

Adding a task: subclass `Task` and register it in `TASKS`.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoTokenizer,
    PreTrainedModel,
    default_data_collator,
)

from data import build_lm_datasets, load_raw_datasets, make_collator
from data.images import build_image_datasets, class_names, load_raw_image_datasets
from models import build_model, build_tokenizer, resolve_block_size
from models.vision import build_image_model, build_image_processor
from training.loss import class_loss_sums, correct_next_tokens, count_target_tokens, token_loss_sums
from training.performance import flops_per_token

Batch = dict[str, torch.Tensor]


class Task:
    """The interface train.py uses; see the module docstring."""

    name: str
    unit: str  # what throughput counts: "tokens" or "samples"

    def __init__(self, model_args, data_args) -> None:
        self.model_args, self.data_args = model_args, data_args
        self.processor = None  # saved beside the exported model
        self.collator = default_data_collator
        self.flops_per_unit: float | None = None  # training FLOPs per unit, for MFU; set by build_model
        self.settings: dict[str, int] = {}  # shape settings, for the logs and trackers

    def load_raw_datasets(self, seed: int) -> DatasetDict: ...
    def build_model(self, raw: DatasetDict) -> PreTrainedModel: ...
    def build_datasets(self, raw: DatasetDict, main_process_first: AbstractContextManager) -> tuple[Dataset, Dataset]: ...
    def forward(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor: ...
    def loss_sums(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]: ...
    def correct(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor: ...
    def count_targets(self, batch: Batch) -> torch.Tensor: ...
    def count_units(self, batch: Batch) -> int: ...
    def describe_data(self, train_set: Dataset) -> str: ...
    def sample(self, final_dir: Path) -> str: ...

    def eval_metrics(self, eval_loss: float, accuracy: float) -> dict[str, float]:
        return {"eval_loss": eval_loss, "eval_accuracy": accuracy}


class CausalLM(Task):
    """Next-token prediction on text; targets are tokens."""

    name, unit = "causal-lm", "tokens"
    SAMPLE_PROMPT = "Once upon a time"

    def __init__(self, model_args, data_args) -> None:
        super().__init__(model_args, data_args)
        self.processor = build_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name, model_args.trust_remote_code)
        self.collator = make_collator(self.processor, data_args.packing)

    def load_raw_datasets(self, seed: int) -> DatasetDict:
        d = self.data_args
        return load_raw_datasets(d.dataset_name, d.dataset_config_name, d.train_file, d.validation_file,
                                 d.validation_split_percentage, seed)

    def build_model(self, raw: DatasetDict) -> PreTrainedModel:
        m = self.model_args
        model = build_model(m.model_name_or_path, m.model_config, self.processor, m.trust_remote_code, m.gradient_checkpointing)
        self.block_size = resolve_block_size(self.data_args.block_size, model.config)
        self.flops_per_unit = flops_per_token(model, self.block_size)
        self.settings = {"block_size": self.block_size}
        return model

    def build_datasets(self, raw: DatasetDict, main_process_first: AbstractContextManager) -> tuple[Dataset, Dataset]:
        return build_lm_datasets(raw, self.processor, self.data_args.text_column, self.block_size, main_process_first,
                                 self.data_args.packing)

    def forward(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits

    def loss_sums(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return token_loss_sums(logits, batch["labels"])

    def correct(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return correct_next_tokens(logits, batch["labels"])

    def count_targets(self, batch: Batch) -> torch.Tensor:
        return count_target_tokens(batch)

    def count_units(self, batch: Batch) -> int:
        return batch["input_ids"].numel()

    def eval_metrics(self, eval_loss: float, accuracy: float) -> dict[str, float]:
        return super().eval_metrics(eval_loss, accuracy) | {"perplexity": math.exp(eval_loss) if eval_loss < 700 else math.inf}

    def describe_data(self, train_set: Dataset) -> str:
        return f"{len(train_set)} sequences of up to {self.block_size} tokens"

    def sample(self, final_dir: Path) -> str:
        model = AutoModelForCausalLM.from_pretrained(final_dir)
        tokenizer = AutoTokenizer.from_pretrained(final_dir)
        inputs = tokenizer(self.SAMPLE_PROMPT, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return repr(tokenizer.decode(output[0], skip_special_tokens=True))


class ImageClassification(Task):
    """One label per image; targets are images."""

    name, unit = "image-classification", "samples"
    SAMPLE_IMAGES = 8

    def __init__(self, model_args, data_args) -> None:
        super().__init__(model_args, data_args)
        self.processor = build_image_processor(model_args.model_name_or_path, model_args.model_config, data_args.image_size)

    def load_raw_datasets(self, seed: int) -> DatasetDict:
        d = self.data_args
        return load_raw_image_datasets(d.dataset_name, d.dataset_config_name, d.train_dir, d.validation_dir,
                                       d.validation_split_percentage, seed, d.image_column, d.label_column)

    def build_model(self, raw: DatasetDict) -> PreTrainedModel:
        m, d = self.model_args, self.data_args
        self.labels, self.raw_validation = class_names(raw, d.label_column), raw["validation"]
        model = build_image_model(m.model_name_or_path, m.model_config, self.labels, m.trust_remote_code,
                                  m.gradient_checkpointing, m.ignore_mismatched_sizes)
        example = self.processor(raw["train"][0][d.image_column].convert("RGB"), return_tensors="pt")["pixel_values"][0]
        self.flops_per_unit = _counted_training_flops(model, example)
        self.settings = {"image_size": example.shape[-1], "num_labels": len(self.labels)}
        return model

    def build_datasets(self, raw: DatasetDict, main_process_first: AbstractContextManager) -> tuple[Dataset, Dataset]:
        return build_image_datasets(raw, self.processor, self.data_args.image_column, self.data_args.label_column)

    def forward(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return model(pixel_values=batch["pixel_values"]).logits

    def loss_sums(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return class_loss_sums(logits, batch["labels"])

    def correct(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return (logits.argmax(dim=-1) == batch["labels"]).long()

    def count_targets(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(batch["labels"].numel(), device=batch["labels"].device)

    def count_units(self, batch: Batch) -> int:
        return batch["labels"].numel()

    def describe_data(self, train_set: Dataset) -> str:
        return f"{len(train_set)} images of {len(self.labels)} classes at {self.settings['image_size']} px"

    def sample(self, final_dir: Path) -> str:
        model = AutoModelForImageClassification.from_pretrained(final_dir).eval()
        processor = AutoImageProcessor.from_pretrained(final_dir, backend="pil")
        examples = self.raw_validation.select(range(min(self.SAMPLE_IMAGES, len(self.raw_validation))))
        images = [image.convert("RGB") for image in examples[self.data_args.image_column]]
        with torch.no_grad():
            predicted = model(**processor(images, return_tensors="pt")).logits.argmax(dim=-1).tolist()
        pairs = [(model.config.id2label[p], self.labels[t]) for p, t in zip(predicted, examples[self.data_args.label_column])]
        right = sum(p == t for p, t in pairs)
        return f"{right}/{len(pairs)} validation images right: " + ", ".join(f"{p} ({t})" if p != t else p for p, t in pairs)


def _counted_training_flops(model: PreTrainedModel, pixel_values: torch.Tensor) -> float:
    """Forward and backward FLOPs per image, counted by torch on a meta-device copy (no memory, no compute).

    Two images: BatchNorm refuses to train on a batch of one.
    """
    with torch.device("meta"):
        meta_model = type(model)(model.config)
    with FlopCounterMode(display=False) as counter:
        meta_model(pixel_values=torch.zeros(2, *pixel_values.shape, device="meta")).logits.sum().backward()
    return counter.get_total_flops() / 2


TASKS: dict[str, type[Task]] = {task.name: task for task in (CausalLM, ImageClassification)}
