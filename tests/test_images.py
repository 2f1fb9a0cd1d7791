"""The images part (parts/images/, `--task image-classification`) through the same train.py: every strategy
config trains a ResNet for real (2 CPU processes; 1 for single.yaml), and every
2-process strategy matches DDP step for step; then the part's pieces alone (models, data, default shapes).

Not single.yaml: BatchNorm normalises each process's micro-batch by its own statistics,
so 2 x 4 images train differently from 1 x 8 (the point of --sync_batchnorm, GPU-only).
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoImageProcessor, AutoModelForImageClassification

from data import DataError
from models.language import ModelError
from parts.images.data import build_image_datasets, load_raw_image_datasets
from parts.images.default_shapes import SHAPES
from parts.images.default_shapes import SPLIT_SIZES as DEFAULT_SPLIT_SIZES
from parts.images.default_shapes import default_shape_splits, draw_shape
from parts.images.models import build_image_model, build_image_processor
from tests.harness import SUITE_FLAGS, launch, read_metrics
from tests.test_effective_config import BF16, assert_runs_bf16_as_asked
from tests.test_strategies import STRATEGIES
from training.checkpoints.tensors import ModelState

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

IMAGE_RUN = ("--task", "image-classification", "--model_config", "resnet-tiny", "--max_steps", "6",
             "--logging_steps", "1", "--eval_steps", "3", "--save_steps", "6", "--warmup_steps", "1",
             "--learning_rate", "3e-3", "--per_device_eval_batch_size", "8", *SUITE_FLAGS)
SPLIT_SIZES = {"train": 120, "validation": 28}  # 28: the last eval batch is uneven on 2 ranks


@pytest.fixture(scope="session")
def shape_folders(tmp_path_factory) -> Path:
    """Default shapes saved as PNG files in the imagefolder layout: <split>/<class>/<n>.png."""
    root = tmp_path_factory.mktemp("shapes")
    for split, dataset in default_shape_splits().items():
        for index, example in enumerate(dataset.select(range(SPLIT_SIZES[split]))):
            folder = root / split / SHAPES[example["label"]]
            folder.mkdir(parents=True, exist_ok=True)
            example["image"].save(folder / f"{index}.png")
    return root


@pytest.fixture(scope="session")
def image_run(tmp_path_factory, shape_folders):
    """`image_run(config)`: 6 steps on the shape folders with a global batch of 8, once per session."""

    @functools.cache
    def run(config: str) -> Path:
        output_dir = tmp_path_factory.mktemp(f"image-{config}")
        per_device = "8" if config == "single" else "4"
        result = launch(config, "train.py", *IMAGE_RUN, "--per_device_train_batch_size", per_device,
                        "--train_dir", str(shape_folders / "train"), "--validation_dir", str(shape_folders / "validation"),
                        "--output_dir", str(output_dir))
        assert result.returncode == 0, f"{config}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        (output_dir / "launch.log").write_text(result.stdout + result.stderr)
        return output_dir

    return run


def exported_accuracy(final: Path, validation: Path) -> float:
    """Accuracy of the exported model on the validation folder, loaded with plain `transformers`."""
    model = AutoModelForImageClassification.from_pretrained(final).float().eval()  # bf16 exports too
    processor = AutoImageProcessor.from_pretrained(final, backend="pil")
    files = sorted(validation.glob("*/*.png"))
    with torch.no_grad():
        logits = model(**processor([Image.open(f).convert("RGB") for f in files], return_tensors="pt")).logits
    predicted = [model.config.id2label[i] for i in logits.argmax(dim=-1).tolist()]
    return sum(label == f.parent.name for label, f in zip(predicted, files)) / len(files)


@pytest.mark.parametrize("config", sorted(STRATEGIES))
def test_every_strategy_trains_the_image_task(config: str, image_run, shape_folders) -> None:
    run = image_run(config)
    log = (run / "launch.log").read_text()
    assert STRATEGIES[config][0] in log
    assert f"{SPLIT_SIZES['train']} images of {len(SHAPES)} classes at 32 px, global batch 8" in log

    metrics = read_metrics(run)
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 7))
    assert all("samples_per_sec" in m and "tokens_per_sec" not in m for m in metrics if "loss" in m)
    evals = [m for m in metrics if "eval_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 3, 6]
    if config not in ("single", "ddp"):
        # Same seed, same split of the global batch: the same losses and evaluation as DDP. Evaluation
        # agrees only because BatchNorm running statistics are averaged over the ranks first.
        for ours, theirs in zip(metrics, read_metrics(image_run("ddp")), strict=True):
            for key in ("loss", "eval_loss", "eval_accuracy"):
                if key in theirs:
                    assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (ours["step"], key)

    final = run / "final"
    assert (final / "model.safetensors").is_file() and (final / "preprocessor_config.json").is_file()
    # The gathered accuracy is the accuracy over every validation image, exactly once each.
    assert exported_accuracy(final, shape_folders / "validation") == pytest.approx(metrics[-1]["eval_accuracy"])
    assert "samples/s:" in log and "validation images right" in log


@pytest.mark.parametrize("config", ["fsdp", "deepspeed_zero2"])
def test_bf16_trains_batch_norm_models(config: str, shape_folders, tmp_path) -> None:
    """bf16 with BatchNorm: FSDP2 computes BatchNorm in fp32 (its own unit), DeepSpeed gets bf16 inputs
    and statistics; both would otherwise stop with a dtype error. These are also the two configs' bf16 runs
    of tests/test_effective_config.py, and get its checks."""
    result = launch(config, "train.py", *IMAGE_RUN, "--per_device_train_batch_size", "4", *BF16, "--train_dir",
                    str(shape_folders / "train"), "--validation_dir", str(shape_folders / "validation"),
                    "--output_dir", str(tmp_path), launcher_args=("--mixed_precision", "bf16"))
    assert result.returncode == 0, f"{config}:\n{result.stderr[-6000:]}"
    metrics = read_metrics(tmp_path)
    assert all(0 < m["loss"] < 5 for m in metrics if "loss" in m)
    # evaluated under bf16 autocast, scored here in the exported weights' own dtype: within one image of 28
    right = [round(accuracy * SPLIT_SIZES["validation"]) for accuracy in
             (exported_accuracy(tmp_path / "final", shape_folders / "validation"), metrics[-1]["eval_accuracy"])]
    assert abs(right[0] - right[1]) <= 1, right
    assert "validation images right" in result.stdout
    assert_runs_bf16_as_asked(config, tmp_path, result.stderr)


@pytest.mark.parts("distillation")
def test_a_classifier_distils_from_a_teacher_with_the_same_labels(image_run, shape_folders, tmp_path) -> None:
    """FSDP2 shards the student and the teacher (the single run's export: BatchNorm, in eval mode): the same
    run as image_run's fsdp one, taught, trains differently from the same start; the teacher is in no checkpoint."""
    plain = image_run("fsdp")
    result = launch("fsdp", "train.py", *IMAGE_RUN, "--per_device_train_batch_size", "4", "--train_dir",
                    str(shape_folders / "train"), "--validation_dir", str(shape_folders / "validation"),
                    "--output_dir", str(tmp_path), "--teacher_model_name_or_path", str(image_run("single") / "final"),
                    "--distillation_alpha", "0.9", "--distillation_temperature", "4")
    assert result.returncode == 0, result.stderr[-6000:]
    assert "teacher state " in result.stdout
    taught, alone = ([m for m in read_metrics(run) if "loss" in m or "eval_loss" in m] for run in (tmp_path, plain))
    assert taught[0]["eval_loss"] == pytest.approx(alone[0]["eval_loss"])  # the same student at the start
    assert all(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(taught, alone) if "loss" in a and "loss" in b)
    final = sorted(load_file(tmp_path / "final" / "model.safetensors"))
    for checkpoint in (tmp_path / "checkpoints").iterdir():  # the student's tensors alone: the teacher is in none
        with contextlib.ExitStack() as files:
            assert sorted(ModelState(checkpoint, files).shapes) == final


def test_the_image_task_learns_the_shapes(tmp_path) -> None:
    """A bound the task must reach: from chance (1 in 5) to twice that in 200 steps of 32 of the 4,000
    embedded images (measured 2026-11-26: 0.20 at step 0, 0.46 at 100, 0.48 at 200; 0.99 after 10 epochs,
    docs/images.md). The 6-step runs above stay near chance."""
    result = launch("single", "train.py", "--task", "image-classification", "--model_config", "resnet-tiny",
                    "--max_steps", "200", "--per_device_train_batch_size", "32", "--learning_rate", "1e-3",
                    "--eval_steps", "100", "--logging_steps", "50", *SUITE_FLAGS, "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-6000:]
    accuracy = {m["step"]: m["eval_accuracy"] for m in read_metrics(tmp_path) if "eval_accuracy" in m}
    assert list(accuracy) == [0, 100, 200]
    assert accuracy[0] < 0.3 and accuracy[200] >= 0.4, accuracy


# ---- the part's pieces, alone (the quick tier) ----

@pytest.mark.quick
def test_default_shapes_are_balanced_drawn_the_same_everywhere_and_ready_for_the_model() -> None:
    assert draw_shape(random.Random(7), 3).tobytes() == draw_shape(random.Random(7), 3).tobytes()
    splits = default_shape_splits()
    assert {name: len(split) for name, split in splits.items()} == DEFAULT_SPLIT_SIZES
    assert splits["train"].features["label"].names == SHAPES
    assert Counter(splits["validation"]["label"]) == {label: 80 for label in range(len(SHAPES))}
    processor = build_image_processor(None, "resnet-tiny", None)
    train_set, _ = build_image_datasets(splits, processor, "image", "label")
    example = train_set[0]
    assert example["pixel_values"].shape == (3, 32, 32) and int(example["labels"]) == 0


@pytest.mark.quick
def test_the_image_task_lets_cudnn_tune_its_convolutions(tmp_path) -> None:
    """Every batch has one shape: cuDNN's autotuner (GPUs) picks the fastest convolutions once per shape."""
    from training.arguments import parse_args
    from training.task_registry import build_task

    model_args, data_args, _ = parse_args(["--task", "image-classification", "--output_dir", str(tmp_path)])
    task = build_task(model_args, data_args)
    try:
        torch.backends.cudnn.benchmark = False
        task.build_model(task.load_raw_datasets(0))
        assert torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = False


@pytest.mark.quick
def test_image_folders_hold_one_class_per_folder_and_missing_ones_are_named(tmp_path) -> None:
    for split, count in (("train", 10), ("validation", 5)):
        for index in range(count):
            folder = tmp_path / split / SHAPES[index % 2]
            folder.mkdir(parents=True, exist_ok=True)
            draw_shape(random.Random(index), index % 2).save(folder / f"{index}.png")
    raw = load_raw_image_datasets(None, None, str(tmp_path / "train"), str(tmp_path / "validation"), 10, seed=0)
    assert raw["train"].features["label"].names == ["circle", "square"] and len(raw["validation"]) == 5
    with pytest.raises(DataError, match="is not a directory"):
        load_raw_image_datasets(None, None, str(tmp_path / "nowhere"), None, 10, seed=0)
    with pytest.raises(DataError, match="column 'class' not found"):
        load_raw_image_datasets(None, None, str(tmp_path / "train"), None, 20, seed=0, label_column="class")


@pytest.mark.quick
def test_an_image_dataset_directory_loads_like_a_hub_dataset(tmp_path) -> None:
    """--dataset_name takes a Hub id or a local dataset directory, through the same `load_dataset`."""
    shapes = default_shape_splits()["validation"]
    for split, rows in (("train", range(0, 300)), ("test", range(300, 400))):
        shapes.select(rows).to_parquet(tmp_path / f"{split}-00000-of-00001.parquet")
    raw = load_raw_image_datasets(str(tmp_path), None, None, None, 10, seed=0)
    assert raw["train"].features["label"].names == SHAPES  # the ClassLabel survives the round trip
    assert len(raw["validation"]) == 30 and len(raw["train"]) == 270  # no validation split: 10% held out per class
    assert Counter(raw["validation"]["label"]) == {label: 6 for label in range(len(SHAPES))}


@pytest.mark.quick
def test_image_models_come_from_a_named_config_or_a_local_directory(tmp_path) -> None:
    model = build_image_model(None, "resnet-tiny", ["a", "b", "c"])
    assert model.config.model_type == "resnet" and model.config.id2label == {0: "a", 1: "b", 2: "c"}
    model.save_pretrained(tmp_path)
    loaded = build_image_model(str(tmp_path), "ignored-when-a-path-is-given", ["a", "b", "c"])
    for (name, expected), (_, actual) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(expected, actual), name
    with pytest.raises(ModelError, match="has a classification head for other labels than your 2; pass --ignore"):
        build_image_model(str(tmp_path), "ignored", ["a", "b"])
    assert build_image_model(str(tmp_path), "ignored", ["a", "b"], ignore_mismatched_sizes=True).config.num_labels == 2


@pytest.mark.quick
def test_a_model_without_gradient_checkpointing_says_so() -> None:
    with pytest.raises(ModelError, match="ResNetForImageClassification does not support --gradient_checkpointing"):
        build_image_model(None, "resnet-tiny", ["a", "b"], gradient_checkpointing=True)
