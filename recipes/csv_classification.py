"""Recipe (b): your own data and task, a CSV of text and label, with a plain PyTorch classifier.

    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml train.py \
        --task recipes.csv_classification:CsvClassification

Your CSVs: add `--train_file train.csv --validation_file val.csv` (without --validation_file, the last tenth of the
training rows). Each has a `text` and a `label` column (any label names). Without --train_file the recipe makes its own:
the first sentence of each document of the embedded corpus, labelled `story` or `arithmetic`. The texts are
tokenised with the shipped tokenizer (or --tokenizer_name); the model averages token embeddings and classifies
them. Everything here is plain PyTorch: a list as the dataset, a collate function, an `nn.Module`.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from torch import nn

from data.default_corpus import generate_documents
from models.language import build_tokenizer
from training.checkpoints.save import load_plain_model
from training.loss import class_loss_sums
from training.tasks import Task


class TextClassifier(nn.Module):
    """Mean of the token embeddings, then an MLP to one logit per label."""

    def __init__(self, vocab_size: int, labels: list[str], hidden: int = 64) -> None:
        super().__init__()
        self.labels = labels
        self.embed = nn.Embedding(vocab_size, hidden)
        self.classify = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, len(labels)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(input_ids)
        mask = attention_mask.unsqueeze(-1).to(embedded.dtype)  # (DeepSpeed's bf16 engine holds bf16 weights)
        return self.classify((embedded * mask).sum(dim=1) / mask.sum(dim=1))


def read_rows(path: str) -> list[tuple[str, str]]:
    with open(path, newline="") as file:
        return [(row["text"], row["label"]) for row in csv.DictReader(file)]


def corpus_rows(count: int, seed: int) -> list[tuple[str, str]]:
    """The embedded corpus's first sentences, labelled by the kind of document they open."""
    return [(document.split(". ")[0] + ".", "story" if document.startswith("Once") else "arithmetic")
            for document in generate_documents(count, seed)]


class CsvClassification(Task):
    """Text classification from CSV files."""

    own_flags = ("train_file", "validation_file", "tokenizer_name")  # the core's flags this task reads

    def __init__(self, model_args, data_args) -> None:
        super().__init__(model_args, data_args)
        self.processor = build_tokenizer(None, model_args.tokenizer_name)
        self.collator = self.pad

    def load_raw_datasets(self, seed: int) -> dict[str, list[tuple[str, str]]]:
        d = self.data_args
        if not d.train_file:
            return {"train": corpus_rows(2000, seed), "validation": corpus_rows(200, seed + 1)}
        rows = read_rows(d.train_file)
        if d.validation_file:
            return {"train": rows, "validation": read_rows(d.validation_file)}
        cut = len(rows) * 9 // 10  # the last tenth for evaluation
        return {"train": rows[:cut], "validation": rows[cut:]}

    def build_model(self, raw, empty: bool = False) -> nn.Module:
        self.model_kwargs = {"vocab_size": len(self.processor), "labels": sorted({label for _, label in raw["train"]})}
        return TextClassifier(**self.model_kwargs)

    def build_datasets(self, raw, main_process_first) -> tuple[list, list]:
        index = {label: i for i, label in enumerate(self.model_kwargs["labels"])}

        def encode(rows: list[tuple[str, str]]) -> list[dict]:
            ids = self.processor([text for text, _ in rows], truncation=True, max_length=64)["input_ids"]
            return [{"input_ids": tokens, "labels": index[label]} for tokens, (_, label) in zip(ids, rows)]

        return encode(raw["train"]), encode(raw["validation"])

    def pad(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        """A batch: token ids padded to the longest, their mask, and the labels."""
        length = max(len(example["input_ids"]) for example in examples)
        ids = torch.full((len(examples), length), self.processor.pad_token_id)
        for row, example in enumerate(examples):
            ids[row, : len(example["input_ids"])] = torch.tensor(example["input_ids"])
        mask = torch.arange(length) < torch.tensor([len(example["input_ids"]) for example in examples])[:, None]
        return {"input_ids": ids, "attention_mask": mask.long(),
                "labels": torch.tensor([example["labels"] for example in examples])}

    def forward(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return model(batch["input_ids"], batch["attention_mask"])

    def loss_sums(self, logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return class_loss_sums(logits, batch["labels"])

    def correct(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return (logits.argmax(dim=-1) == batch["labels"]).long()

    def sample(self, final_dir: Path) -> str:
        """The model rebuilt from final/, labelling one sentence of each kind."""
        model = load_plain_model(final_dir).eval()
        texts = ["Once upon a time, there was a shy fox named Max.", "Two plus three is five."]
        batch = self.pad([{"input_ids": ids, "labels": 0} for ids in self.processor(texts)["input_ids"]])
        with torch.no_grad():
            predicted = model(batch["input_ids"], batch["attention_mask"]).argmax(dim=-1)
        return ", ".join(f"{text!r} -> {model.labels[i]}" for text, i in zip(texts, predicted.tolist()))
