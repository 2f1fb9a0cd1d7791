"""The embedded fine-tuning set: short conversations made here, never downloaded.

Each conversation asks to repeat or to reverse a few words. Only the prompt tells which
words and which order, so a model that answers right has read it, and no held-out request
is in the training set. Some conversations open with a system message and some run two
turns, so the answer mask is exercised on every shape. Seeded: every machine builds the same set.
"""

from __future__ import annotations

import random

SFT_VERSION = "2"  # bump when the generator changes, so cached tokenizations are rebuilt
WORDS = ["fox", "owl", "cat", "dog", "bear", "frog", "duck", "wolf", "goat", "deer", "mouse", "rabbit",
         "red", "blue", "green", "key", "book", "apple", "hat", "lamp", "ball", "map", "coin", "bell"]
SYSTEM = "Answer with the words only."
TRAIN_CONVERSATIONS = 4000
VALIDATION_CONVERSATIONS = 200


def instruction(rng: random.Random) -> tuple[str, str]:
    """One request and its answer."""
    words = rng.sample(WORDS, rng.randint(2, 4))
    if rng.random() < 0.5:
        return f"Repeat: {' '.join(words)}", " ".join(words)
    return f"Reverse: {' '.join(words)}", " ".join(reversed(words))


def conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    for _ in range(2 if rng.random() < 0.2 else 1):
        request, answer = instruction(rng)
        messages += [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
    return messages


def requests(messages: list[dict[str, str]]) -> set[str]:
    return {m["content"] for m in messages if m["role"] == "user"}


def default_sft_splits(seed: int = 0) -> dict[str, list[list[dict[str, str]]]]:
    """`train` and `validation` lists of conversations (`messages`); no request of a validation
    conversation is in the training set, so its answers can only come from reading it."""
    rng = random.Random(seed)
    train = [conversation(rng) for _ in range(TRAIN_CONVERSATIONS)]
    seen = set().union(*map(requests, train))
    validation = []
    while len(validation) < VALIDATION_CONVERSATIONS:
        if not requests(candidate := conversation(rng)) & seen:
            validation.append(candidate)
    return {"train": train, "validation": validation}
