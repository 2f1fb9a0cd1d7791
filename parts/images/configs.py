"""Named ResNets for `--task image-classification` (`--model_config NAME`), each sized for one job.

Like models/configs.py, this imports nothing heavy: `train.py --help` lists the names before torch loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    from transformers import ResNetConfig


def label_maps(labels: list[str]) -> dict[str, dict]:
    """`id2label` and `label2id` for a classification config: the class names go into the export."""
    return {"id2label": dict(enumerate(labels)), "label2id": {label: index for index, label in enumerate(labels)}}


class ImageConfig(NamedTuple):
    make: Callable[[list[str]], ResNetConfig]  # class names -> config
    image_size: int  # the side in pixels the image processor resizes to


def _resnet(embedding: int, widths: list[int], depths: list[int]) -> Callable[[list[str]], ResNetConfig]:
    def make(labels: list[str]) -> ResNetConfig:
        from transformers import ResNetConfig

        return ResNetConfig(embedding_size=embedding, hidden_sizes=widths, depths=depths, layer_type="basic",
                            num_labels=len(labels), **label_maps(labels))

    return make


IMAGE_CONFIGS: dict[str, ImageConfig] = {
    "resnet-tiny": ImageConfig(_resnet(16, [16, 32, 64, 128], [1, 1, 1, 1]), 32),  # 0.3M: tests, the default image job
    "resnet-18": ImageConfig(_resnet(64, [64, 128, 256, 512], [2, 2, 2, 2]), 224),  # ResNet-18's shape (11M)
}


def build_image_config(name: str, labels: list[str]) -> ResNetConfig:
    """The image config called `name`, with a classification head for `labels`."""
    if name not in IMAGE_CONFIGS:
        raise ValueError(f"unknown --model_config {name!r} for images; choose one of {sorted(IMAGE_CONFIGS)}")
    return IMAGE_CONFIGS[name].make(labels)
