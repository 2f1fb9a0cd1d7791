"""What is learned (`--task`): model, data and loss; the loop is the same for every task. Add one as a `Task` subclass
(`--task module:Class`, see recipes/), or register it in `CORE_TASKS` (training/task_registry.py) or `Part.tasks`."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict, IterableDataset
from torch.utils.data import Subset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, default_data_collator

from data import TextReading, build_lm_datasets, load_raw_datasets, make_collator
from models.configs import describe_shape
from models.language import build_model, build_tokenizer, resolve_block_size
from training.parts import part_tasks, parts
from training.loss import IGNORE_INDEX, correct_next_tokens, count_target_tokens, token_loss_sums
from training.performance import flops_per_token

Batch = dict[str, torch.Tensor]


class Task(ABC):
    """The interface train.py uses: implement the three abstract methods; every other method has a default."""

    unit = "samples"  # what throughput counts (`count_units`): "samples", or "tokens"
    model_input = "input_ids"  # the batch key `forward` feeds the model (a pipeline's first stage is fed it)
    auto_model: type | None = None  # a transformers Auto class that loads this task's models (a distillation teacher)
    can_build_empty = False  # build_model honours `empty` (training/strategy/accelerator.py `model_construction`)
    own_flags: tuple[str, ...] = ()  # core flags a `--task module:Class` reads (e.g. "train_file"); others are refused

    def __init__(self, model_args, data_args) -> None:
        self.name = model_args.task  # its key in training/task_registry.py, or module:Class
        self.model_args, self.data_args = model_args, data_args
        self.processor = None  # tokenizer or image processor, saved beside the exported model
        self.collator = default_data_collator
        self.flops_per_unit: float | None = None  # training FLOPs per unit, for MFU; set by build_model
        self.settings: dict[str, int] = {}  # shape settings for the logs and trackers; set by build_model
        self.model_kwargs: dict | None = None  # a plain nn.Module's constructor arguments, for final/model.json
        self.model_name: str | None = None  # how logs and summary.json name the model (its class when unset)

    @abstractmethod
    def build_model(self, raw, empty: bool = False) -> torch.nn.Module:
        """The model, fp32: any `nn.Module` whose forward returns logits, or an output with `.logits`. `raw`: what
        `load_raw_datasets` read; `empty` (if `can_build_empty`): uninitialised, rank 0's weights come in `prepare`."""

    @abstractmethod
    def build_datasets(self, raw, main_process_first: AbstractContextManager) -> tuple[Dataset, Dataset]:
        """Train and eval sets, map-style `Dataset`s; in `main_process_first` the main process goes first (to cache)."""

    @abstractmethod
    def loss_sums(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-example label-loss sums over the targets, and the targets counted: `eval_loss` is their global ratio."""

    def load_raw_datasets(self, seed: int):
        """What is read before the model is built (by the main process first), handed to both builders."""
        return None

    def forward(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The logits of `batch`: the model run on its `model_input`."""
        output = model(batch[self.model_input])
        return getattr(output, "logits", output)

    def objective_sums(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Per-example sums training minimises: the label loss unless overridden (label smoothing, a z-loss)."""
        return self.loss_sums(logits, batch)[0]

    def correct(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """Per-example counts of right answers, for `eval_accuracy`; None: no accuracy."""
        return None

    def count_targets(self, batch: Batch) -> torch.Tensor:
        """The targets in a batch, as `loss_sums` counts them: by default every label but ignored ones."""
        return (batch["labels"] != IGNORE_INDEX).sum()

    def count_units(self, batch: Batch) -> int:
        """What throughput counts in a batch (`unit`): its examples by default."""
        return len(batch[self.model_input])

    def describe_data(self, train_set: Dataset) -> str:
        return f"{len(train_set)} training examples"

    def describe_model(self, model: torch.nn.Module) -> str:
        """The model in one phrase, for the start-up log and the dry run: its class, unless a task says more."""
        return type(model).__name__

    def sample(self, final_dir: Path) -> str:
        """What the exported model does, shown at the end (loaded from `final_dir`); nothing by default."""
        return "(none: the task shows no sample)"

    def eval_sums(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """Named per-example sums, totalled over the validation set on every rank for `eval_metrics`; add your own."""
        loss, targets = self.loss_sums(logits, batch)
        correct = self.correct(logits, batch)
        return {"loss": loss, "targets": targets, **({"correct": correct} if correct is not None else {})}

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """The metrics (named eval_*) from `eval_sums`' totals over the validation set."""
        accuracy = {"eval_accuracy": totals["correct"] / totals["targets"]} if "correct" in totals else {}
        return {"eval_loss": totals["loss"] / totals["targets"], **accuracy}

    def generation_metrics(self, model: torch.nn.Module, accelerator) -> dict[str, float]:
        """Metrics of what the model generates, run on every rank in evaluation; none by default."""
        return {}

    def datasets(self, raw, main_process_first: AbstractContextManager) -> tuple[Dataset, Dataset]:
        """`build_datasets`, cut to the first --max_train_samples / --max_eval_samples examples."""
        train_set, eval_set = self.build_datasets(raw, main_process_first)
        return _first(train_set, self.data_args.max_train_samples), _first(eval_set, self.data_args.max_eval_samples)


def _first(dataset: Dataset, count: int | None) -> Dataset | Subset:
    """The first `count` examples (any map-style dataset: a torch Subset, not datasets' select)."""
    return dataset if count is None or count >= len(dataset) else Subset(dataset, range(count))


class CausalLM(Task):
    """Next-token prediction on text; targets are tokens."""

    unit = "tokens"
    auto_model = AutoModelForCausalLM
    can_build_empty = True

    def __init__(self, model_args, data_args) -> None:
        super().__init__(model_args, data_args)
        self.processor = build_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name, model_args.trust_remote_code)
        self.collator = make_collator(self.processor, data_args.packing)
        self.block_size = 0  # the model's maximum unless --block_size; set by build_model
        # a part's source of sequences, if the flags chose one (a stream, pre-tokenised shards; training/parts.py)
        self.source = next(iter(parts().text_source(data_args)), None)

    def load_raw_datasets(self, seed: int) -> DatasetDict | object:
        """The documents, loaded whole; or what a part's source reads first."""
        d = self.data_args
        if self.source:
            return self.source.load(seed)
        return load_raw_datasets(d.dataset_name, d.dataset_config_name, d.train_file, d.validation_file,
                                 d.validation_split_percentage, seed, TextReading(d.sample_by, d.keep_linebreaks))

    def build_model(self, raw: DatasetDict, empty: bool = False) -> PreTrainedModel:
        m, d = self.model_args, self.data_args
        model = build_model(m.model_name_or_path, m.model_config, self.processor, m.trust_remote_code,
                            m.gradient_checkpointing, empty, m.config_overrides)
        self.model_name = m.model_name_or_path or m.model_config
        self.block_size = resolve_block_size(d.block_size or (self.source and self.source.block_size()), model.config)
        self.flops_per_unit = flops_per_token(model, self.block_size)
        self.settings = {"block_size": self.block_size}
        return model

    def build_datasets(self, raw: DatasetDict, main_process_first: AbstractContextManager) -> tuple[Dataset, Dataset]:
        d = self.data_args
        if self.source:
            return self.source.datasets(raw, self.processor, self.block_size, main_process_first)
        return build_lm_datasets(raw, self.processor, d.text_column, self.block_size, main_process_first, d.packing,
                                 task_hint=other_task_hint)

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

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        metrics = super().eval_metrics(totals)
        return metrics | {"perplexity": math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else math.inf}

    def describe_model(self, model: torch.nn.Module) -> str:
        """Its shape, and what --config_overrides made the named config derive again."""
        config = getattr(model, "config", None)
        return describe_shape(config, self.model_args.config_overrides) if config is not None else super().describe_model(model)

    def describe_data(self, train_set: Dataset | IterableDataset) -> str:
        if isinstance(train_set, IterableDataset):  # a stream (a part's source): no length
            return f"a stream of sequences of up to {self.block_size} tokens ({train_set.num_shards} shards)"
        return f"{len(train_set)} sequences of up to {self.block_size} tokens"

    def sample(self, final_dir: Path) -> str:
        model = AutoModelForCausalLM.from_pretrained(final_dir)
        tokenizer = AutoTokenizer.from_pretrained(final_dir)
        inputs = tokenizer(self.data_args.sample_prompt, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return repr(tokenizer.decode(output[0], skip_special_tokens=True))


def next_token_loss_as_is(task: Task) -> bool:
    """Whether `task` trains with the causal LM's own forward and next-token loss (a part that computes that loss its
    own way, fused or compiled with the model, needs them)."""
    kind = type(task)
    return (kind.forward, kind.loss_sums, kind.objective_sums) == (CausalLM.forward, CausalLM.loss_sums, Task.objective_sums)


def other_task_hint(columns: set[str]) -> str | None:
    """What to do with data that a part's task reads (`TaskEntry.data_columns`), for a message that names it."""
    task = next((name for name, entry in part_tasks().items() if any(marks <= columns for marks in entry.data_columns)),
                None)
    return f"fine-tune on it with --task {task}" if task else None
