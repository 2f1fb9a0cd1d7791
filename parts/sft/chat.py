"""Instruction and chat data (supervised fine-tuning): TRL's formats, the chat template, the answer mask.

Formats, recognised from the columns (TRL's names):
- conversational `messages`: a list of `{role, content}`;
- `prompt` + `completion`: each plain text, or a list of messages.

Messages are rendered with the tokenizer's chat template (a plain-text completion after a
messages prompt is the assistant's answer). Plain-text prompt/completion is joined as it is,
with the tokenizer's BOS and an EOS, as TRL does: base models have no template.

The mask. Hub templates (ChatML, Llama 3, Mistral) mostly lack `{% generation %}` markers, so
the answers are found by rendering the conversation prefix by prefix: the characters an
assistant turn adds (its content and its end-of-turn marker) are the answer. The whole
conversation is tokenized once, and a token is a target when it starts inside an answer,
so the tokens are the ones the model sees at inference, whatever BPE merges across turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from training.errors import DataError

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
Span = tuple[int, int]  # [start, end) characters of the rendered text that are learned
LABELS_VERSION = 2  # in every tokenized cache's key (SFT's, DPO's): 2, a token shared by prompt and answer is scored


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
                    f"{list(columns)}); rename yours to TRL's names, or see docs/sft.md")


def check_example(example: dict[str, Any], data_format: str, where: str, answer: str = "completion") -> None:
    """Every message has a known role and text content; a plain-text prompt has a plain-text completion (`answer`:
    its column, DPO's `chosen` or `rejected`)."""
    fields = ["messages"] if data_format == "messages" else ["prompt", answer]
    for field in fields:
        value = example[field]
        if isinstance(value, str):
            continue
        if not isinstance(value, list) or not value:
            raise DataError(f"{where}: {field!r} must be text or a non-empty list of {{role, content}} messages")
        for number, message in enumerate(value):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                raise DataError(f"{where}: message {number} of {field!r} has role {role!r}; use one of {list(ROLES)}")
            if not isinstance(message.get("content"), str) or not message["content"]:
                raise DataError(f"{where}: message {number} of {field!r} ({role}) has no text content")
    if data_format == "prompt-completion" and isinstance(example["prompt"], str) and not isinstance(example[answer], str):
        raise DataError(f"{where}: a plain-text prompt needs a plain-text {answer!r} (or give both as messages)")
    if data_format == "messages" and not any(m["role"] == "assistant" for m in example["messages"]):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing to learn")


def is_plain_text(example: dict[str, Any], data_format: str) -> bool:
    """Prompt/completion as plain text: joined as it is, no chat template."""
    return data_format == "prompt-completion" and isinstance(example["prompt"], str)


def conversation(example: dict[str, Any], data_format: str) -> tuple[list[dict], int]:
    """The example as messages, and how many of them are the prompt (a plain completion becomes the assistant's)."""
    if data_format == "messages":
        return example["messages"], 0
    completion = example["completion"]
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    return example["prompt"] + completion, len(example["prompt"])


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> str:
    """The chat template's text; a template that refuses the conversation (alternating roles, no system
    role, ...) is a DataError, not a traceback."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as error:
        raise DataError(f"the chat template refused a conversation ({error}); fix the data or give another "
                        "template with --chat_template PATH".replace("\n", " ")) from None


def rendered_with_answers(
    example: dict[str, Any], data_format: str, tokenizer: PreTrainedTokenizerBase, answers_only: bool
) -> tuple[str, list[Span]]:
    """The example's training text and the character spans the loss is on (all of it unless `answers_only`)."""
    if is_plain_text(example, data_format):  # as TRL: BOS (if the tokenizer adds one) + prompt + completion + EOS
        completion = example["completion"]
        text = example["prompt"] + completion + ("" if completion.endswith(tokenizer.eos_token) else tokenizer.eos_token)
        return text, [(len(example["prompt"]) if answers_only else 0, len(text))]
    messages, prompt_length = conversation(example, data_format)
    text = render(tokenizer, messages)
    if not answers_only:
        return text, [(0, len(text))]
    answers = [turn for turn in range(prompt_length, len(messages)) if messages[turn]["role"] == "assistant"]
    return text, [answer_span(tokenizer, messages, turn, text) for turn in answers]


def answer_span(tokenizer: PreTrainedTokenizerBase, messages: list[dict], turn: int, text: str) -> Span:
    """The characters of `text` that assistant message `turn` adds: from the end of the conversation before
    it, rendered with the generation prompt, to the end of the conversation through it (less the EOS some
    templates close a conversation with, where the next turn follows instead)."""
    before = render(tokenizer, messages[:turn], generation_prompt=True) if turn else ""
    through = render(tokenizer, messages[: turn + 1])
    if not text.startswith(through) and through.endswith(tokenizer.eos_token):
        through = through.removesuffix(tokenizer.eos_token)
    end = len(through)
    if not text.startswith(before) or not text.startswith(through) or messages[turn]["content"].strip() not in text[len(before):end]:
        raise DataError(
            "the chat template renders a conversation differently once it grows (it rewrites earlier turns, for "
            "example dropping the reasoning of past answers), so the answer tokens cannot be found; use a template "
            "that only appends (--chat_template PATH), or train on every token (--assistant_only_loss false)"
        )
    return len(before), end


def tokenize_with_mask(
    text: str, spans: list[Span], tokenizer: PreTrainedTokenizerBase, plain_text: bool = False
) -> tuple[list[int], list[int], bool]:
    """Token ids of `text`; labels: the id where the token starts inside a span, or starts before one and ends in it
    (a prompt's last space merged with the answer's first digits, " 46" after "= ": the answer's, as TRL 1.x scores
    it), -100 elsewhere; and whether such a shared token was found. A template writes its own special tokens (BOS);
    plain text gets the tokenizer's."""
    encoded = tokenizer(text, add_special_tokens=plain_text, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    if trims_offsets(tokenizer):
        offsets = untrimmed(text, offsets)
    labels, shared = [], False
    for token, (begin, end) in zip(encoded["input_ids"], offsets):
        straddles = any(begin < start < end for start, _ in spans)
        shared |= straddles
        labels.append(token if straddles or any(start <= begin < stop for start, stop in spans) else IGNORE_INDEX)
    return encoded["input_ids"], labels, shared


def trims_offsets(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's offsets leave out whitespace its tokens hold (a byte-level BPE's `trim_offsets`)."""
    from tokenizers import processors

    processor = getattr(getattr(tokenizer, "backend_tokenizer", None), "post_processor", None)
    members = list(processor) if isinstance(processor, processors.Sequence) else [processor]
    return any(getattr(member, "trim_offsets", False) for member in members)


def untrimmed(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Trimmed offsets with the whitespace given back to the token that holds it: a byte-level token begins where the
    one before it ended, where only whitespace lies between (trimmed, a lone space of a prompt's end, (4, 5), reads
    (5, 5) and would be the answer's; " 46", (4, 7), reads (5, 7) and would not be seen to straddle the two)."""
    given_back, end = [], 0
    for begin, stop in offsets:
        if end <= begin and text[end:begin].isspace():
            begin = end
        given_back.append((begin, stop))
        end = max(end, stop)
    return given_back


def shared_tokens(examples: int) -> str:
    """The start-up line's count of examples whose answer begins inside the prompt's last token ("" for none)."""
    return f"; {examples} with a token shared by prompt and answer, scored as the answer's" if examples else ""


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
    packed), with `truncated` marking cut examples and `shared` those whose answer starts inside a prompt's token.
    Dropped examples, and examples with no target left after cutting, are left out."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "truncated": [], "shared": []}
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    for example in rows:
        text, spans = rendered_with_answers(example, data_format, tokenizer, answers_only)
        input_ids, labels, shared = tokenize_with_mask(text, spans, tokenizer, is_plain_text(example, data_format))
        cut = truncate(input_ids, labels, max_length, truncation_mode)
        if cut is None or all(label == IGNORE_INDEX for label in cut[1][1:]):  # the first label predicts nothing
            continue
        out["input_ids"].append(cut[0])
        out["labels"].append(cut[1])
        out["truncated"].append(len(cut[0]) < len(input_ids))
        out["shared"].append(shared)
    return out


def generation_prompt(example: dict[str, Any], data_format: str, tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """The text a model is given at inference (everything before the last answer), and that answer."""
    if is_plain_text(example, data_format):
        return example["prompt"], example["completion"]
    messages, _ = conversation(example, data_format)
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
