"""Chat and instruction data (parts/sft/chat.py): formats, the answer mask token by token, truncation,
and a loss that does not depend on how a global batch of masked examples is split."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradientAccumulationPlugin
from transformers import AutoModelForCausalLM

from models.configs import build_named_config
from models.language import build_tokenizer
from parts.sft.chat import (
    IGNORE_INDEX,
    check_example,
    end_of_answer,
    recognise_format,
    rendered_with_answers,
    tokenize_conversations,
    tokenize_with_mask,
    truncate,
)
from parts.sft.default_sft import default_sft_splits, requests
from training.checkpoints.files import TrainerState
from training.errors import DataError
from training.runner import ModelRunner
from training.step import NonFiniteGuard, objective_sums, optimizer_step

pytestmark = pytest.mark.quick
CONVERSATION = [
    {"role": "system", "content": "Answer with the words only."},
    {"role": "user", "content": "Reverse: fox owl"},
    {"role": "assistant", "content": "owl fox"},
    {"role": "user", "content": "Repeat: cat"},
    {"role": "assistant", "content": "cat"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(None, None)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_loss_falls_on_each_answer_and_its_end_of_turn_token_by_token(tokenizer) -> None:
    text, spans = rendered_with_answers({"messages": CONVERSATION}, "messages", tokenizer, answers_only=True)
    input_ids, labels, shared = tokenize_with_mask(text, spans, tokenizer)
    assert not shared  # the template's markers end every prompt
    # The shipped ChatML template; its turn markers are single tokens, so the pieces tokenize apart.
    pieces = [("<|im_start|>system\nAnswer with the words only.<|im_end|>\n", False),
              ("<|im_start|>user\nReverse: fox owl<|im_end|>\n<|im_start|>assistant\n", False),
              ("owl fox<|im_end|>\n", True),
              ("<|im_start|>user\nRepeat: cat<|im_end|>\n<|im_start|>assistant\n", False),
              ("cat<|im_end|>\n", True)]
    assert text == "".join(piece for piece, _ in pieces)
    expected_ids = [token for piece, _ in pieces for token in ids(tokenizer, piece)]
    expected_labels = [token if learned else IGNORE_INDEX for piece, learned in pieces for token in ids(tokenizer, piece)]
    assert input_ids == expected_ids
    assert labels == expected_labels
    _, every_token, _ = tokenize_with_mask(*rendered_with_answers({"messages": CONVERSATION}, "messages", tokenizer, False),
                                        tokenizer)
    assert every_token == input_ids


@pytest.mark.parametrize("conversational", [False, True])
def test_prompt_completion_learns_the_completion_only(tokenizer, conversational) -> None:
    if conversational:
        example = {"prompt": [{"role": "user", "content": "Repeat: cat"}],
                   "completion": [{"role": "assistant", "content": "cat"}]}
        prompt, answer = "<|im_start|>user\nRepeat: cat<|im_end|>\n<|im_start|>assistant\n", "cat<|im_end|>\n"
    else:  # plain text, as TRL joins it: no template, EOS at the end
        example = {"prompt": "Repeat: cat =", "completion": " cat"}
        prompt, answer = "Repeat: cat =", " cat<|endoftext|>"
    input_ids, labels, _ = tokenize_with_mask(*rendered_with_answers(example, "prompt-completion", tokenizer, True), tokenizer)
    assert input_ids == ids(tokenizer, prompt) + ids(tokenizer, answer)
    assert labels == [IGNORE_INDEX] * len(ids(tokenizer, prompt)) + ids(tokenizer, answer)
    assert end_of_answer(tokenizer, plain_text=not conversational) == ("<|endoftext|>" if not conversational else "<|im_end|>")


WRITTEN_AS_USERS_WRITE = ["Q: 12 + 34 = 46.", "Translate: chat -> cat", "Say yes: yes", "x=1;y=22"]


@pytest.mark.parametrize("text", WRITTEN_AS_USERS_WRITE)
def test_every_character_of_the_answer_is_scored_wherever_the_prompt_ends(tokenizer, text) -> None:
    """Each split of `text` into a plain-text prompt and its completion, at every character: a token that joins the
    prompt's end and the answer's start (" 46" after "= ") was labelled the prompt's, so the answer's first token was
    never scored. Now every character of the answer lies in a scored token, no scored token lies in the prompt
    alone, and an example with a shared token is counted."""
    for cut in range(1, len(text)):
        example = {"prompt": text[:cut], "completion": text[cut:]}
        out = tokenize_conversations({key: [value] for key, value in example.items()}, tokenizer, "prompt-completion",
                                     True, max_length=1000, truncation_mode="keep_start")
        labels = out["labels"][0]
        offsets = tokenizer(text + tokenizer.eos_token, return_offsets_mapping=True)["offset_mapping"]
        assert out["input_ids"][0] == tokenizer(text + tokenizer.eos_token)["input_ids"]  # as at inference
        scored = [(begin, end) for (begin, end), label in zip(offsets, labels) if label != IGNORE_INDEX]
        assert all(any(begin <= char < end for begin, end in scored) for char in range(cut, len(text))), example
        assert all(end > cut for _, end in scored), example
        assert out["shared"] == [any(begin < cut < end for begin, end in offsets)], example
    pieces = tokenize_conversations({"prompt": ["Q: 12 + 34 = "], "completion": ["46."]}, tokenizer, "prompt-completion",
                                    True, max_length=1000, truncation_mode="keep_start")
    assert tokenizer.decode([label for label in pieces["labels"][0] if label != IGNORE_INDEX]) == " 46.<|endoftext|>"
    assert pieces["shared"] == [True]


def byte_level_tokenizer(trim_offsets: bool):
    """A byte-level BPE as GPT-2 and RoBERTa build theirs, trained here on a few sentences, with or without
    `trim_offsets` (whose offsets leave out the whitespace a token holds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([*WRITTEN_AS_USERS_WRITE, *SPACED] * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


SPACED = ["Q:  12 +  34 =  46 .", "a  b", "Say  yes :   yes"]  # lone and doubled spaces, which trimming drops


def test_trimmed_offsets_of_a_byte_level_tokenizer_mask_what_untrimmed_ones_mask() -> None:
    """With `trim_offsets`, a prompt's lone space read (5, 5) and was scored as the answer's, and " 46" read (5, 7) and
    was not counted as shared (issue 69). Every cut of every text: the labels and the shared flag are those of the same
    tokenizer without trimming, whose offsets hold each token's whitespace."""
    trimming, untrimmed = byte_level_tokenizer(True), byte_level_tokenizer(False)
    for text in [*WRITTEN_AS_USERS_WRITE, *SPACED]:
        for cut in range(1, len(text)):
            batch = {"prompt": [text[:cut]], "completion": [text[cut:]]}
            got, truth = (tokenize_conversations(batch, tokenizer, "prompt-completion", True, max_length=1000,
                                                 truncation_mode="keep_start") for tokenizer in (trimming, untrimmed))
            assert (got["labels"], got["shared"]) == (truth["labels"], truth["shared"]), batch
            offsets = untrimmed(text + "<|endoftext|>", return_offsets_mapping=True)["offset_mapping"]
            scored = [(begin, end) for (begin, end), label in zip(offsets, truth["labels"][0]) if label != IGNORE_INDEX]
            assert all(end > cut for _, end in scored) and truth["shared"] == [any(b < cut < e for b, e in offsets)]


# Hub-style templates without {% generation %} markers: a BOS and a default system prompt written by the
# template (Llama 3 style), and EOS closing the conversation where the next turn would follow (Phi-3 style).
HUB_TEMPLATES = {
    "llama-3 style": ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
                      "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "phi-3 style": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}{{ eos_token }}{% endif %}"),
}


@pytest.mark.parametrize("name", HUB_TEMPLATES)
def test_hub_style_templates_mask_exactly_the_answers_and_their_end_of_turn(tokenizer, name) -> None:
    templated = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    templated.chat_template = HUB_TEMPLATES[name]
    text, spans = rendered_with_answers({"messages": CONVERSATION[1:]}, "messages", templated, answers_only=True)
    input_ids, labels, _ = tokenize_with_mask(text, spans, templated)
    learned = [token for token, label in zip(input_ids, labels) if label != IGNORE_INDEX]
    # the conversation's closing EOS is learned with the last answer (where to stop), not after the first
    closing = [tokenizer.eos_token_id] if name == "phi-3 style" else []
    assert learned == ids(tokenizer, "owl fox<|im_end|>\n") + ids(tokenizer, "cat<|im_end|>\n") + closing
    assert labels[0] == IGNORE_INDEX and input_ids.count(tokenizer.eos_token_id) == 1  # BOS / EOS written once


def test_a_plain_completion_after_a_messages_prompt_is_the_assistants_answer(tokenizer) -> None:
    example = {"prompt": [{"role": "user", "content": "Repeat: cat"}], "completion": "cat"}
    check_example(example, "prompt-completion", "train example 0")
    input_ids, labels, _ = tokenize_with_mask(*rendered_with_answers(example, "prompt-completion", tokenizer, True), tokenizer)
    assert [t for t, l in zip(input_ids, labels) if l != IGNORE_INDEX] == ids(tokenizer, "cat<|im_end|>\n")


def test_a_template_that_rewrites_earlier_turns_is_named(tokenizer) -> None:
    rewriting = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    rewriting.chat_template = ("{{ messages | length }} turns\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DataError, match="renders a conversation differently once it grows"):
        rendered_with_answers({"messages": CONVERSATION}, "messages", rewriting, answers_only=True)
    rendered_with_answers({"messages": CONVERSATION}, "messages", rewriting, answers_only=False)  # every token: no mask


@pytest.mark.parametrize(("columns", "expected"), [(["messages", "id"], "messages"), (["prompt", "completion"], "prompt-completion")])
def test_the_format_is_recognised_from_the_columns(columns, expected) -> None:
    assert recognise_format(columns) == expected


@pytest.mark.parametrize(("columns", "message"), [
    (["text"], "plain 'text' column"), (["question", "answer"], "none of the columns text, messages, or prompt and completion"),
])
def test_data_that_is_not_chat_data_is_named(columns, message) -> None:
    with pytest.raises(DataError, match=message):
        recognise_format(columns)


@pytest.mark.parametrize(("example", "message"), [
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "role 'robot'"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "has no text content"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
])
def test_a_bad_message_is_named_with_its_example(example, message) -> None:
    with pytest.raises(DataError, match=f"train example 7: .*{message}"):
        check_example(example, "messages", "train example 7")


def test_truncation_keeps_the_start_or_the_end_or_drops() -> None:
    tokens, labels = list(range(10)), [IGNORE_INDEX] * 5 + list(range(5, 10))
    assert truncate(tokens, labels, 4, "keep_start") == ([0, 1, 2, 3], [IGNORE_INDEX] * 4)
    assert truncate(tokens, labels, 4, "keep_end") == ([6, 7, 8, 9], [6, 7, 8, 9])
    assert truncate(tokens, labels, 4, "drop") is None
    assert truncate(tokens, labels, 10, "drop") == (tokens, labels)


def test_examples_cut_to_no_answer_are_left_out_and_cut_ones_marked(tokenizer) -> None:
    batch = {"messages": [CONVERSATION, CONVERSATION[:3]]}
    settings = {"tokenizer": tokenizer, "data_format": "messages", "answers_only": True, "truncation_mode": "keep_start"}
    whole = tokenize_conversations(batch, max_length=1000, **settings)
    assert whole["truncated"] == [False, False]
    cut = tokenize_conversations(batch, max_length=len(whole["input_ids"][1]) - 2, **settings)
    assert cut["truncated"] == [True, True] and len(cut["input_ids"]) == 2  # the first still has its first answer
    assert len(tokenize_conversations(batch, max_length=12, **settings)["input_ids"]) == 0  # no answer left in 12 tokens


def test_the_embedded_set_is_the_same_everywhere_and_held_out() -> None:
    splits = default_sft_splits()
    assert splits == default_sft_splits()
    assert len(splits["train"]) == 4000 and len(splits["validation"]) == 200
    seen = set().union(*map(requests, splits["train"]))
    assert not any(requests(conversation) & seen for conversation in splits["validation"])


def test_accumulation_1x8_and_4x2_give_the_same_loss_and_gradients_on_masked_data(tokenizer) -> None:
    """train.py's own optimizer step (training/step.py) on one process: a global batch of 8 masked, padded conversations as one
    micro-batch, or as 4 accumulated micro-batches of 2 (each padded to its own length)."""
    from data import make_collator
    from training.tasks import CausalLM

    encoded = tokenize_conversations({"messages": default_sft_splits()["train"][:8]}, tokenizer, "messages", True, 128, "keep_start")
    examples = [{"input_ids": i, "labels": l} for i, l in zip(encoded["input_ids"], encoded["labels"])]
    collate = make_collator(tokenizer, packing=False)
    task = CausalLM.__new__(CausalLM)  # its forward, loss and counts only

    def step(micro_batch: int) -> tuple[float, dict[str, torch.Tensor]]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accumulation = 8 // micro_batch
        accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=accumulation, sync_with_dataloader=False))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(build_named_config("llama-tiny", tokenizer))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        kept = {}  # the window's gradients, copied when the prepared optimizer clears them after the step
        optimizer.zero_grad = lambda set_to_none=True: kept.update({n: p.grad.clone() for n, p in model.named_parameters()})
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        model, optimizer = accelerator.prepare(model, optimizer)
        run = SimpleNamespace(accelerator=accelerator, task=task, model=model, optimizer=optimizer, scheduler=scheduler,
                              torch_optimizer=optimizer.optimizer, state=TrainerState(), args=SimpleNamespace(max_grad_norm=0.0),
                              runner=ModelRunner(accelerator), objective=partial(objective_sums, task))
        window = [collate(examples[i:i + micro_batch]) for i in range(0, 8, micro_batch)]
        loss, _, _ = optimizer_step(run, window, NonFiniteGuard(accelerator.device))
        return float(loss), kept

    whole_loss, whole_grads = step(8)
    split_loss, split_grads = step(2)
    assert split_loss == pytest.approx(whole_loss, rel=1e-6)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
