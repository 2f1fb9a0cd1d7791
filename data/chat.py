"""Instruction and chat data (supervised fine-tuning): TRL's formats, the chat template, the answer mask.

Formats, recognised from the columns (TRL's names):
- conversational `messages`: a list of `{role, content}`;
- `prompt` + `completion`: each plain text, or a list of messages.

Messages are rendered with the tokenizer's chat template. Plain-text prompt/completion is
joined as it is and ends with EOS, as TRL does: base models have no template.

The mask. Hub templates (ChatML, Llama 3, Mistral) mostly lack `{% generation %}` markers, so
the answers are found by rendering the conversation prefix by prefix: the characters an
assistant turn adds (its content and its end-of-turn marker) are the answer. The whole
conversation is tokenized once, and a token is a target when it starts inside an answer,
so the tokens are the ones the model sees at inference, whatever BPE merges across turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from data.errors import DataError

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
TRUNCATION_MODES = ("keep_start", "keep_end", "drop")
Span = tuple[int, int]  # [start, end) characters of the rendered text that are learned


def recognise_format(columns: Sequence[str]) -> str:
    """`messages` or `prompt-completion`, from the dataset's columns; a clear error otherwise."""
    if "messages" in columns:
        return "messages"
    if {"prompt", "completion"} <= set(columns):
        return "prompt-completion"
    if "text" in columns:
        raise DataError(f"the data has a plain 'text' column (columns: {list(columns)}), not chat data; train on it "
                        "with --task causal-lm, or give a 'messages' or 'prompt'/'completion' column")
    raise DataError(f"the data has none of the columns text, messages, or prompt and completion (columns: "
                    f"{list(columns)}); rename yours to TRL's names, or see docs/fine-tuning.md")


def check_example(example: dict[str, Any], data_format: str, where: str) -> None:
    """Every message has a known role and text content; prompt and completion are both text or both messages."""
    fields = ["messages"] if data_format == "messages" else ["prompt", "completion"]
    kinds = set()
    for field in fields:
        value = example[field]
        if isinstance(value, str):
            kinds.add("text")
            continue
        kinds.add("messages")
        if not isinstance(value, list) or not value:
            raise DataError(f"{where}: {field!r} must be text or a non-empty list of {{role, content}} messages")
        for number, message in enumerate(value):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                raise DataError(f"{where}: message {number} of {field!r} has role {role!r}; use one of {list(ROLES)}")
            if not isinstance(message.get("content"), str) or not message["content"]:
                raise DataError(f"{where}: message {number} of {field!r} ({role}) has no text content")
    if len(kinds) > 1:
        raise DataError(f"{where}: prompt and completion must both be text or both be lists of messages")
    if data_format == "messages" and not any(m["role"] == "assistant" for m in example["messages"]):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing to learn")


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def rendered_with_answers(
    example: dict[str, Any], data_format: str, tokenizer: PreTrainedTokenizerBase, answers_only: bool
) -> tuple[str, list[Span]]:
    """The example's training text and the character spans the loss is on (all of it unless `answers_only`)."""
    if data_format == "prompt-completion" and isinstance(example["prompt"], str):
        text = example["prompt"] + example["completion"] + tokenizer.eos_token
        return text, [(len(example["prompt"]) if answers_only else 0, len(text))]
    if data_format == "prompt-completion":
        prompt, full = example["prompt"], example["prompt"] + example["completion"]
        text = render(tokenizer, full)
        if not answers_only:
            return text, [(0, len(text))]
        return text, [(_prefix_length(tokenizer, prompt, text, generation_prompt=True), len(text))]
    messages = example["messages"]
    text = render(tokenizer, messages)
    if not answers_only:
        return text, [(0, len(text))]
    spans = [(_prefix_length(tokenizer, messages[:turn], text, generation_prompt=True),
              _prefix_length(tokenizer, messages[: turn + 1], text))
             for turn, message in enumerate(messages) if message["role"] == "assistant"]
    return text, spans


def _prefix_length(tokenizer: PreTrainedTokenizerBase, prefix: list[dict], text: str, generation_prompt: bool = False) -> int:
    """Characters of `text` that the conversation `prefix` renders to; an error if it is not a prefix."""
    rendered = render(tokenizer, prefix, generation_prompt) if prefix else ""
    if not text.startswith(rendered):
        raise DataError(
            "the chat template renders a conversation differently once it grows (it rewrites earlier turns, for "
            "example dropping the reasoning of past answers), so the answer tokens cannot be found; use a template "
            "that only appends (--chat_template PATH), or train on every token (--assistant_only_loss false)"
        )
    return len(rendered)


def tokenize_with_mask(
    text: str, spans: list[Span], tokenizer: PreTrainedTokenizerBase
) -> tuple[list[int], list[int]]:
    """Token ids of `text`, and labels: the id where the token starts inside a span, -100 elsewhere."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [token if any(start <= begin < end for start, end in spans) else IGNORE_INDEX
              for token, (begin, _) in zip(encoded["input_ids"], encoded["offset_mapping"])]
    return encoded["input_ids"], labels


def truncate(input_ids: list[int], labels: list[int], max_length: int, mode: str) -> tuple[list[int], list[int]] | None:
    """Cut to `max_length` tokens, keeping the start or the end; None to drop the example."""
    if len(input_ids) <= max_length:
        return input_ids, labels
    if mode == "drop":
        return None
    keep = slice(None, max_length) if mode == "keep_start" else slice(-max_length, None)
    return input_ids[keep], labels[keep]


def tokenize_conversations(
    batch: dict[str, list[Any]], tokenizer: PreTrainedTokenizerBase, data_format: str, answers_only: bool,
    max_length: int, truncation_mode: str,
) -> dict[str, list]:
    """`datasets.map` function: examples in, `input_ids`/`labels` out (one sequence per example, never
    packed), with `truncated` marking cut examples. Dropped examples, and examples with no target left
    after cutting, are left out."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "truncated": []}
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    for example in rows:
        text, spans = rendered_with_answers(example, data_format, tokenizer, answers_only)
        input_ids, labels = tokenize_with_mask(text, spans, tokenizer)
        cut = truncate(input_ids, labels, max_length, truncation_mode)
        if cut is None or all(label == IGNORE_INDEX for label in cut[1][1:]):  # the first label predicts nothing
            continue
        out["input_ids"].append(cut[0])
        out["labels"].append(cut[1])
        out["truncated"].append(len(cut[0]) < len(input_ids))
    return out


def generation_prompt(example: dict[str, Any], data_format: str, tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """The text a model is given at inference (everything before the last answer), and that answer."""
    if data_format == "prompt-completion" and isinstance(example["prompt"], str):
        return example["prompt"], example["completion"]
    if data_format == "prompt-completion":
        return render(tokenizer, example["prompt"], generation_prompt=True), example["completion"][-1]["content"]
    messages = example["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return render(tokenizer, messages[:last], generation_prompt=True), messages[last]["content"]


def end_of_answer(tokenizer: PreTrainedTokenizerBase, plain_text: bool) -> str:
    """What the template writes after an answer's content (ChatML: `<|im_end|>`); EOS for plain text."""
    if plain_text:
        return tokenizer.eos_token
    marker = "\x00answer\x00"
    conversation = [{"role": "user", "content": "question"}, {"role": "assistant", "content": marker}]
    after = render(tokenizer, conversation).split(marker, 1)[1].strip()
    return after or tokenizer.eos_token
