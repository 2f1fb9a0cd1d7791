"""The embedded default image dataset: shapes drawn here, never downloaded.

Each image is a small RGB picture of one filled shape (the label) at a random size,
position and rotation, in a random colour on a random background. A fixed seed draws the
same pictures on every machine. It is easy enough for a small ResNet to learn in a few
minutes on a CPU and hard enough that an untrained one sits at chance.
"""

from __future__ import annotations

import math
import random

from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
from PIL import Image as PILImage
from PIL import ImageDraw

SHAPES = ["circle", "square", "triangle", "cross", "star"]
IMAGE_SIZE = 32
SPLIT_SIZES = {"train": 4000, "validation": 400}
SEED = 20261122


def _polygon(shape: str, cx: float, cy: float, radius: float, angle: float) -> list[tuple[float, float]]:
    """The outline of `shape` centred at (cx, cy), rotated by `angle` radians."""
    if shape == "square":
        points = [(1, 1), (-1, 1), (-1, -1), (1, -1)]
        points = [(x * radius / math.sqrt(2), y * radius / math.sqrt(2)) for x, y in points]
    elif shape == "triangle":
        points = [(radius * math.cos(a), radius * math.sin(a)) for a in (math.pi / 2 + k * 2 * math.pi / 3 for k in range(3))]
    elif shape == "star":
        points = [
            ((radius if k % 2 == 0 else radius * 0.45) * math.cos(math.pi / 2 + k * math.pi / 5),
             (radius if k % 2 == 0 else radius * 0.45) * math.sin(math.pi / 2 + k * math.pi / 5))
            for k in range(10)
        ]
    else:  # cross: a plus sign of arm width radius / 3
        w = radius / 3
        points = [(w, radius), (-w, radius), (-w, w), (-radius, w), (-radius, -w), (-w, -w),
                  (-w, -radius), (w, -radius), (w, -w), (radius, -w), (radius, w), (w, w)]
    cos, sin = math.cos(angle), math.sin(angle)
    return [(cx + x * cos - y * sin, cy + x * sin + y * cos) for x, y in points]


def _colour(rng: random.Random) -> tuple[int, int, int]:
    return rng.randrange(256), rng.randrange(256), rng.randrange(256)


def draw_shape(rng: random.Random, label: int, size: int = IMAGE_SIZE) -> PILImage.Image:
    """One picture of SHAPES[label]; shape and background colours differ clearly."""
    background = _colour(rng)
    colour = _colour(rng)
    while sum(abs(a - b) for a, b in zip(colour, background)) < 200:
        colour = _colour(rng)
    image = PILImage.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    radius = rng.uniform(0.22, 0.42) * size
    cx, cy = (rng.uniform(radius, size - radius) for _ in range(2))
    if SHAPES[label] == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=colour)
    else:
        draw.polygon(_polygon(SHAPES[label], cx, cy, radius, rng.uniform(0, 2 * math.pi)), fill=colour)
    return image


def default_shape_splits() -> DatasetDict:
    """`train` and `validation` splits with an `image` column and a `label` ClassLabel column."""
    features = Features({"image": Image(), "label": ClassLabel(names=SHAPES)})
    splits = {}
    for offset, (split, count) in enumerate(SPLIT_SIZES.items()):
        rng = random.Random(SEED + offset)  # the splits never share a picture's random draws
        labels = [index % len(SHAPES) for index in range(count)]  # balanced classes
        images = [draw_shape(rng, label) for label in labels]
        splits[split] = Dataset.from_dict({"image": images, "label": labels}, features=features)
    return DatasetDict(splits)
