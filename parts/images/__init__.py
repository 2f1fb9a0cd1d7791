"""Image classification (`--task image-classification`): ResNets from scratch or any pretrained
`AutoModelForImageClassification`, on an image dataset, local class folders, or the embedded default
shapes. docs/images.md.

    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --task image-classification

`task.py` is the `Task` (model, data, loss: one label per image); `models.py` the models and image
processors, `configs.py` the named ResNets, `data.py` the image sources, `default_shapes.py` the
embedded default images. Nothing here imports torch: `train.py --help` lists the task before it loads.
"""

from dataclasses import dataclass, field

from parts.images.configs import IMAGE_CONFIGS
from training.errors import ArgumentError
from training.parts import Flags, Part, TaskEntry


@dataclass
class ImageFlags:
    train_dir: str | None = field(default=None, metadata={"help": "Images: a folder with one sub-folder per class."})
    validation_dir: str | None = field(default=None, metadata={"help": "Images: same layout as --train_dir."})
    image_column: str = field(default="image", metadata={"help": "Images: the column that holds the images."})
    label_column: str = field(default="label", metadata={"help": "Images: the column that holds the labels."})
    image_size: int | None = field(default=None, metadata={
        "help": "Images: side in pixels the images are resized to. Default: the model's."})
    ignore_mismatched_sizes: bool = field(default=False, metadata={
        "help": "Images: replace a pretrained classification head made for other labels."})


class Images(Part):
    name = "images"
    description = "image classification: ResNets or any pretrained image classifier (--task image-classification)"
    flags = ImageFlags
    run_inputs = ("train_dir", "validation_dir")
    tasks = {"image-classification": TaskEntry("parts.images.task:ImageClassification", IMAGE_CONFIGS, "resnet-tiny",
                                               ("train_dir", "validation_dir", "image_column", "label_column",
                                                "image_size", "ignore_mismatched_sizes"))}

    def check_flags(self, flags: Flags) -> None:
        """One source of images, and a size only where the model is built here."""
        data = flags.data
        if data.dataset_name and data.parts.images.train_dir:
            raise ArgumentError("--dataset_name and --train_dir exclude each other; give one")
        if data.parts.images.image_size is not None and (data.parts.images.image_size < 8 or flags.model.model_name_or_path):
            raise ArgumentError(f"--image_size {data.parts.images.image_size}: at least 8 pixels, and only for --model_config models "
                                "(a pretrained model's processor keeps the size it was trained at)")
        if data.parts.images.validation_dir and not data.parts.images.train_dir:
            raise ArgumentError("--validation_dir needs --train_dir")


PART = Images()
