"""`--task dpo`: the policy and the reference scored on both answers of each pair, the DPO loss per pair.

Each example holds a `prompt`, a `chosen` and a `rejected` answer (TRL's columns), as plain text or as messages;
each answer is rendered after its prompt as SFT renders a prompt-completion example (parts/sft/chat.py), and its
log-probability is the sum over the answer's tokens. A batch holds the chosen sequences, then the rejected ones,
so that one forward of each model scores both. A prompt over --max_prompt_length keeps its end (TRL 0.24's
truncation), an example over --max_length keeps its start or end (--truncation_mode, SFT's flag and TRL's name;
keep_start by default, as TRL 1.x); both are counted in the log.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple

import datasets
import torch
from datasets import Dataset, DatasetDict, load_dataset

from data import DataError, cache_key, local_files
from parts.dpo.default_dpo import DPO_VERSION, default_dpo_splits
from parts.dpo.loss import dpo_loss, sequence_log_probs
from parts.sft.chat import (
    IGNORE_INDEX,
    LABELS_VERSION,
    check_example,
    generation_prompt,
    is_plain_text,
    rendered_with_answers,
    shared_tokens,
    tokenize_with_mask,
    truncate,
)
from parts.sft.task import SupervisedFineTuning, check_chat_template, check_fast_tokenizer
from training.tasks import Batch

COLUMNS = ("prompt", "chosen", "rejected")
PAIRS_FORMAT = 3  # bump when tokenize_pairs' columns change, so cached tokenizations are rebuilt
PAD_TO_MULTIPLE_OF = 8
# what the pairs' figures are named in metrics.jsonl (TRL's), and the per-pair sums they come from
FIGURES = {"rewards/chosen": "rewards_chosen", "rewards/rejected": "rewards_rejected",
           "rewards/accuracies": "accuracies", "rewards/margins": "margins", "logps/chosen": "logps_chosen",
           "logps/rejected": "logps_rejected"}


def pair_sums(scores: torch.Tensor, beta: float, loss_type: str, label_smoothing: float) -> dict[str, torch.Tensor]:
    """Per pair: the loss, and the figures' values (`FIGURES`), from the (pairs, 4) log-probabilities of
    (policy chosen, policy rejected, reference chosen, reference rejected)."""
    losses, chosen, rejected = dpo_loss(*scores.unbind(dim=1), beta, loss_type, label_smoothing)
    return {"loss": losses, "rewards_chosen": chosen, "rewards_rejected": rejected,
            "accuracies": (chosen > rejected).float(), "margins": chosen - rejected,
            "logps_chosen": scores[:, 0].detach(), "logps_rejected": scores[:, 1].detach()}


class PairFigures:
    """`LoggedFigures` (training/performance.py) of the pairs trained since the last log (or, for summary.json, in the
    whole launch): their sums on this rank, then the means over every rank's pairs, by TRL's names."""

    steady = ()

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = {}
        self.run_sums: dict[str, torch.Tensor | float] = {}  # the logged intervals', for the whole launch

    def add(self, sums: dict[str, torch.Tensor]) -> None:
        self.sums["pairs"] = self.sums.get("pairs", 0.0) + len(sums["loss"])
        for name in FIGURES.values():
            self.sums[name] = self.sums.get(name, 0.0) + sums[name].detach().sum()

    def local(self, units: int, seconds: float, whole_run: bool) -> dict[str, torch.Tensor | float]:
        names = ("pairs", *FIGURES.values())
        if whole_run:
            return {f"dpo {name}": self.run_sums.get(name, 0.0) + self.sums.get(name, 0.0) for name in names}
        local = {f"dpo {name}": self.sums.get(name, 0.0) for name in names}
        self.run_sums = {name: self.run_sums.get(name, 0.0) + self.sums.get(name, 0.0) for name in names}
        self.sums = {}
        return local

    def report(self, ranks: dict[str, torch.Tensor], units_per_sec: float) -> dict[str, float]:
        pairs = float(ranks["dpo pairs"].sum())
        return {name: float(ranks[f"dpo {key}"].sum()) / pairs for name, key in FIGURES.items()} if pairs else {}


class DirectPreference(SupervisedFineTuning):
    """Pairs of answers to one prompt; the target is the preference, one per pair."""

    def __init__(self, model_args, data_args) -> None:
        super().__init__(model_args, data_args)
        self.collator = PairCollator(self.processor.pad_token_id)
        self.dpo = data_args.parts.dpo
        # (policy, batch, average) -> the reference's log-probabilities of the batch's sequences: set by the part
        # once the policy is placed (parts/dpo/reference.py); None: reference-free
        self.reference: Callable[[torch.nn.Module, Batch, bool], torch.Tensor] | None = None
        # (pair_index, 2): the reference's log-probabilities of each pair's answers, when precomputed
        self.reference_table: torch.Tensor | None = None
        self.reference_identity: dict | None = None  # the loaded reference's record (training/checkpoints/frozen.py)
        self.pairs: list[Dataset] = []  # the tokenized training and validation pairs (a precomputing pass reads them)
        self.figures = PairFigures()
        self.prompts_cut = 0

    def load_raw_datasets(self, seed: int) -> DatasetDict:
        """The user's pairs (each row checked, named by its place in the file or split as given, before any is held
        out for validation), or the embedded ones."""
        d = self.data_args
        if not (d.dataset_name or d.train_file):
            return DatasetDict({split: Dataset.from_list(pairs) for split, pairs in default_dpo_splits().items()})
        if d.dataset_name:
            given = {f"{d.dataset_name} {name}": split for name, split in load_dataset(d.dataset_name, d.dataset_config_name).items()}
        else:  # each file apart: a file without a column is named before `datasets` casts one to the other
            builder, files = local_files(d.train_file, d.validation_file)
            given = {path: load_dataset(builder, data_files={name: path})[name] for name, path in files.items()}
        for source, split in given.items():
            if missing := [column for column in COLUMNS if column not in split.column_names]:
                raise DataError(f"{source} has no {' or '.join(repr(c) for c in missing)} column (columns: "
                                f"{split.column_names}); DPO reads TRL's prompt, chosen and rejected")
            for index, example in enumerate(split):
                check_pair(example, f"{source} row {index + 1}")
        return super(SupervisedFineTuning, self).load_raw_datasets(seed)  # the core's: read (from the cache), split

    def build_datasets(self, raw: DatasetDict, main_process_first: AbstractContextManager) -> tuple[Dataset, Dataset]:
        tokenizer = self.processor  # (every row was checked as it was read, on every rank)
        self.data_format = "prompt-completion"
        self.plain_text = is_plain_text({"prompt": raw["train"][0]["prompt"]}, self.data_format)
        if not self.plain_text:
            check_chat_template(tokenizer)
        check_fast_tokenizer(tokenizer)
        truncation = self.data_args.parts.sft.truncation_mode
        settings = {"tokenizer": tokenizer, "max_length": self.block_size, "max_prompt_length": self.dpo.max_prompt_length,
                    "truncation_mode": truncation}
        offsets = {"train": 0, "validation": len(raw["train"])}  # `pair_index`: a pair's row in both splits
        cache_dir = Path(datasets.config.HF_DATASETS_CACHE) / "dpo"
        cache_dir.mkdir(parents=True, exist_ok=True)
        tokenized = {}
        with main_process_first:
            for name, split in raw.items():
                key = cache_key(split, f"default-dpo-{DPO_VERSION}", tokenizer, self.block_size,
                                self.dpo.max_prompt_length, truncation, offsets[name], PAIRS_FORMAT, LABELS_VERSION)
                tokenized[name] = split.map(tokenize_pairs, batched=True, batch_size=500, with_indices=True,
                                            fn_kwargs=settings | {"offset": offsets[name]},
                                            remove_columns=split.column_names, new_fingerprint=key,
                                            cache_file_name=str(cache_dir / f"{key}.arrow"), desc=f"Formatting {name}")
        train = tokenized["train"]
        self.pairs = [tokenized[name].remove_columns(["prompt_cut", "truncated", "shared"])
                      for name in ("train", "validation")]
        self.prompts_cut, self.truncated, self.shared = (sum(train[flag]) for flag in ("prompt_cut", "truncated", "shared"))
        self.dropped = len(raw["train"]) - len(train)
        if self.prompts_cut and int(os.environ.get("RANK", "0")) == 0:  # TRL cuts them without a word
            logging.getLogger(__name__).warning(
                f"{self.prompts_cut} of {len(train)} training prompts are longer than --max_prompt_length "
                f"{self.dpo.max_prompt_length}: each keeps its last {self.dpo.max_prompt_length} tokens")
        samples = raw["validation"].select(range(min(self.data_args.parts.sft.eval_generation_samples,
                                                     len(raw["validation"]))))
        self.prompts = [generation_prompt({"prompt": e["prompt"], "completion": e["chosen"]}, self.data_format,
                                              tokenizer) for e in samples]
        return self.pairs[0], self.pairs[1]

    def describe_data(self, train_set: Dataset) -> str:
        truncation = self.data_args.parts.sft.truncation_mode
        dropped = "longer than --max_length" if truncation == "drop" else "with no answer left"
        return (f"{len(train_set)} preference pairs ({self.prompts_cut} prompts cut to --max_prompt_length "
                f"{self.dpo.max_prompt_length}, {self.truncated} cut to --max_length {self.block_size} ({truncation}), "
                f"{self.dropped} dropped {dropped}{shared_tokens(self.shared)}); {self.dpo.loss_type} loss, "
                f"beta {self.dpo.beta}")

    def forward(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """(pairs, 4): the answers' log-probabilities under the policy (chosen, rejected) and the reference."""
        average = self.dpo.loss_type == "ipo"  # IPO compares the answers' mean log-probabilities
        if self.reference_table is not None:
            reference = self.reference_table[batch["pair_index"]].T.reshape(-1)  # chosen ones, then rejected
        elif self.reference is None:
            reference = torch.zeros(batch["input_ids"].shape[0], device=batch["input_ids"].device)
        else:
            reference = self.reference(model, batch, average)
        policy = sequence_log_probs(model, batch, average)
        return torch.stack([*policy.chunk(2), *reference.detach().chunk(2)], dim=1)

    def objective_sums(self, scores: torch.Tensor, batch: Batch) -> torch.Tensor:
        sums = pair_sums(scores, self.dpo.beta, self.dpo.loss_type, self.dpo.label_smoothing)
        self.figures.add(sums)
        return sums["loss"]

    def loss_sums(self, scores: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        losses = pair_sums(scores, self.dpo.beta, self.dpo.loss_type, self.dpo.label_smoothing)["loss"]
        return losses, torch.ones_like(losses)

    def count_targets(self, batch: Batch) -> torch.Tensor:
        return torch.tensor(batch["input_ids"].shape[0] // 2, device=batch["input_ids"].device)

    def eval_sums(self, scores: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        sums = pair_sums(scores, self.dpo.beta, self.dpo.loss_type, self.dpo.label_smoothing)
        return {"loss": sums["loss"], "targets": torch.ones_like(sums["loss"]), **{k: sums[k] for k in FIGURES.values()}}

    def eval_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        pairs = totals["targets"]
        return {"eval_loss": totals["loss"] / pairs, **{f"eval_{name}": totals[key] / pairs for name, key in FIGURES.items()}}


def check_pair(example: dict, where: str) -> None:
    """A prompt and two answers, as SFT checks a prompt-completion example, that differ."""
    for answer in ("chosen", "rejected"):
        if example[answer] is None or (isinstance(example[answer], str | list) and not example[answer]):
            raise DataError(f"{where}: no {answer!r} answer; every pair needs both")
        check_example(example, "prompt-completion", where, answer)
    if example["chosen"] == example["rejected"]:
        raise DataError(f"{where}: the chosen answer is the rejected one, so there is no preference; fix or drop the row")


def tokenize_pair_answer(prompt, answer, tokenizer, max_length: int, max_prompt_length: int,
                         truncation_mode: str) -> PairAnswer | None:
    """One answer after its prompt, its labels the answer's; a prompt over `max_prompt_length` keeps its end, then
    the whole over `max_length` its start or end (`truncation_mode`, SFT's; None: dropped)."""
    example = {"prompt": prompt, "completion": answer}
    text, spans = rendered_with_answers(example, "prompt-completion", tokenizer, answers_only=True)
    ids, labels, shared = tokenize_with_mask(text, spans, tokenizer, is_plain_text(example, "prompt-completion"))
    prompt_tokens = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    prompt_cut = prompt_tokens > max_prompt_length
    if prompt_cut:
        ids, labels = ids[prompt_tokens - max_prompt_length:], labels[prompt_tokens - max_prompt_length:]
    cut = truncate(ids, labels, max_length, truncation_mode)
    return cut and PairAnswer(*cut, prompt_cut, len(cut[0]) < len(ids), shared)


class PairAnswer(NamedTuple):
    input_ids: list[int]
    labels: list[int]
    prompt_cut: bool  # to --max_prompt_length
    truncated: bool  # to --max_length
    shared: bool  # a token shared by the prompt's end and the answer's start (scored as the answer's)


def tokenize_pairs(batch: dict[str, list], indices: list[int], tokenizer, max_length: int, max_prompt_length: int,
                   truncation_mode: str, offset: int = 0) -> dict[str, list]:
    """`datasets.map` function: pairs in, each answer's ids and labels out, and the pair's row (+ `offset`); a pair
    left with an answer of no target (cut away, or dropped by --truncation_mode drop) is dropped."""
    out = {f"{answer}_{key}": [] for answer in ("chosen", "rejected") for key in ("input_ids", "labels")}
    out |= {"pair_index": [], "prompt_cut": [], "truncated": [], "shared": []}
    for index, prompt, chosen, rejected in zip(indices, batch["prompt"], batch["chosen"], batch["rejected"]):
        scored = [tokenize_pair_answer(prompt, answer, tokenizer, max_length, max_prompt_length, truncation_mode)
                  for answer in (chosen, rejected)]
        if any(answer is None or all(label == IGNORE_INDEX for label in answer.labels[1:]) for answer in scored):
            continue
        for name, answer in zip(("chosen", "rejected"), scored):
            out[f"{name}_input_ids"].append(answer.input_ids)
            out[f"{name}_labels"].append(answer.labels)
        out["pair_index"].append(index + offset)
        for flag in ("prompt_cut", "truncated", "shared"):
            out[flag].append(any(getattr(answer, flag) for answer in scored))
    return out


class PairCollator:
    """A batch of pairs as one of sequences: the chosen ones, then the rejected ones, right-padded to one length
    (a multiple of 8), labels -100 on the padding."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, examples: list[dict]) -> Batch:
        ids = [e["chosen_input_ids"] for e in examples] + [e["rejected_input_ids"] for e in examples]
        labels = [e["chosen_labels"] for e in examples] + [e["rejected_labels"] for e in examples]
        width = -(-max(len(sequence) for sequence in ids) // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF

        def padded(rows: list[list[int]], value: int) -> torch.Tensor:
            return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows])

        return {"input_ids": padded(ids, self.pad_token_id), "labels": padded(labels, IGNORE_INDEX),
                "attention_mask": padded([[1] * len(row) for row in ids], 0),
                "pair_index": torch.tensor([e["pair_index"] for e in examples])}
