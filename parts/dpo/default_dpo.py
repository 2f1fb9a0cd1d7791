"""The embedded preference set: SFT's requests (repeat or reverse a few words, parts/sft/default_sft.py), each with
the right answer preferred to a wrong one: the other order, or one word changed. Made here, never downloaded;
seeded, so every machine builds the same pairs; no validation request is in the training set."""

from __future__ import annotations

import random

from parts.sft.default_sft import SYSTEM, WORDS, instruction

DPO_VERSION = "2"  # bump when the generator changes, so cached tokenizations are rebuilt
TRAIN_PAIRS = 2000
VALIDATION_PAIRS = 200


def wrong_answer(rng: random.Random, answer: str) -> str:
    """One of the words changed to one the request does not hold."""
    words = answer.split()
    index = rng.randrange(len(words))
    words[index] = rng.choice([word for word in WORDS if word not in words])
    return " ".join(words)


def pair(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """One request (sometimes after the system message), its right answer and a wrong one, as messages."""
    request, answer = instruction(rng)
    prompt = ([{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []) + [{"role": "user", "content": request}]
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": wrong_answer(rng, answer)}]}


def default_dpo_splits(seed: int = 0) -> dict[str, list[dict]]:
    """`train` and `validation` lists of pairs (TRL's conversational prompt/chosen/rejected)."""
    rng = random.Random(seed)
    train = [pair(rng) for _ in range(TRAIN_PAIRS)]
    seen = {example["prompt"][-1]["content"] for example in train}
    validation = []
    while len(validation) < VALIDATION_PAIRS:
        if (candidate := pair(rng))["prompt"][-1]["content"] not in seen:
            validation.append(candidate)
    return {"train": train, "validation": validation}
