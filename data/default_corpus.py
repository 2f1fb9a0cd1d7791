"""The embedded default corpus: stories and arithmetic from a seeded grammar, the same on every machine, never
downloaded. Characters keep name, species and pronoun through a story and sums are right: a small model can learn it."""

from __future__ import annotations

import random

CORPUS_VERSION = "1"  # bump when the grammar changes, so cached tokenizations are rebuilt

NAMES = {"she": ["Mia", "Lena", "Ada", "Nora", "Ivy", "Rosa", "Hana", "Zoe", "Ella", "Maya", "Lucy", "Iris"],
         "he": ["Tom", "Leo", "Max", "Omar", "Finn", "Hugo", "Ben", "Sam", "Kai", "Eli", "Jack", "Noah"]}
ANIMALS = ["fox", "rabbit", "bear", "owl", "cat", "dog", "mouse", "frog", "duck", "wolf", "deer", "goat"]
ADJECTIVES = ["small", "brave", "quiet", "clever", "happy", "curious", "kind", "shy", "proud", "gentle"]
PLACES = ["forest", "village", "garden", "valley", "river", "hill", "farm", "lake", "meadow", "castle"]
OBJECTS = ["stone", "key", "book", "apple", "hat", "lamp", "ball", "shell", "feather", "map", "coin", "bell"]
COLORS = ["red", "blue", "green", "yellow", "silver", "golden", "white", "black", "purple", "orange"]
SPOTS = ["a tree", "a rock", "the bridge", "a bush", "the old well", "a log", "the fence", "a pile of leaves"]
FRIENDS_DO = ["played a game", "shared a meal", "sang a song", "built a tower", "watched the stars", "went for a walk"]
FEELINGS = ["happy", "tired", "surprised", "proud", "excited", "calm"]
MORALS = ["it is good to share", "friends make every day better", "small things can matter a lot",
          "asking for help is brave", "patience brings good things", "kindness comes back to you"]
WORD_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _story(rng: random.Random) -> str:
    pronoun = rng.choice(["she", "he"])
    possessive = "her" if pronoun == "she" else "his"
    name = rng.choice(NAMES[pronoun])
    animal, adjective, place = rng.choice(ANIMALS), rng.choice(ADJECTIVES), rng.choice(PLACES)
    thing, color, spot = rng.choice(OBJECTS), rng.choice(COLORS), rng.choice(SPOTS)
    friend_pronoun = rng.choice(["she", "he"])
    friend = rng.choice([n for n in NAMES[friend_pronoun] if n != name])
    friend_animal = rng.choice(ANIMALS)
    count = rng.randint(2, 9)
    lines = [
        f"Once upon a time, there was {_article(adjective)} {adjective} {animal} named {name}.",
        f"{name} lived in the {place} with {possessive} family.",
        f"One day, {name} found {_article(color)} {color} {thing} under {spot}.",
        f"{pronoun.capitalize()} picked up the {color} {thing} and looked at it for a long time.",
        f"Then {name} met {friend}, {_article(friend_animal)} {friend_animal} from the next {rng.choice(PLACES)}.",
        f'"Look at my {thing}!" said {name}. "{friend_pronoun.capitalize()} found {count} of them too," said {friend}\'s mother.',
        f"Together they {rng.choice(FRIENDS_DO)} until the sun went down.",
        f"{name} felt {rng.choice(FEELINGS)}, and {pronoun} learned that {rng.choice(MORALS)}.",
    ]
    return " ".join(lines)


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 5), rng.randint(0, 5)
    x, y = rng.randint(10, 99), rng.randint(10, 99)
    return (f"{WORD_NUMBERS[a].capitalize()} plus {WORD_NUMBERS[b]} is {WORD_NUMBERS[a + b]}. "
            f"{x} + {y} = {x + y}. {max(x, y)} - {min(x, y)} = {max(x, y) - min(x, y)}.")


def generate_documents(num_documents: int, seed: int) -> list[str]:
    """Return `num_documents` documents; the same arguments always give the same text."""
    rng = random.Random(seed)
    return [_arithmetic(rng) if rng.random() < 0.2 else _story(rng) for _ in range(num_documents)]


def default_splits(num_train: int = 8_000, num_validation: int = 400) -> dict[str, list[str]]:
    return {"train": generate_documents(num_train, seed=1234),
            "validation": generate_documents(num_validation, seed=5678)}
