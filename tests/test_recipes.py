"""The four recipes of docs/recipes.md, run as written: each file of recipes/ is launched with the config file and
`--task` its docstring's command names (shortened for CI, as every test run: the tiny model, 12 steps), and gives
one process's losses at the parity tolerance. Together they cover ddp, fsdp and deepspeed_zero3; the CSV
classifier also resumes exactly. Recipes on the core's data compare with the parity runs' one process
(tests/conftest.py `strategy_run`), which they must equal: no extra reference run."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from scripts.compare_metrics import compare, worst_difference
from tests.harness import (
    REPO,
    SHOWN_FLAGS,
    TINY_RUN,
    assert_continues_exactly,
    assert_same_final_weights,
    parity_args,
    read_metrics,
    train,
    validation_batches,
)
from tests.test_parity import LOSS_TOLERANCE
from training.arguments import ArgumentError, parse_args
from training.checkpoints.save import load_plain_model
from training.loss import token_loss_sums
from training.parts import installed
from training.task_registry import build_task

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

DOCS = (REPO / "docs" / "recipes.md").read_text()
PARITY_KEYS = ("loss", "lr", "eval_loss")


def documented_launch(recipe: str) -> tuple[str, list[str]]:
    """The config file and train.py arguments of the command in `recipes/<recipe>.py`'s docstring."""
    docstring = importlib.import_module(f"recipes.{recipe}").__doc__
    line = re.search(r"^\s+(accelerate launch (?:[^\n]*\\\n)*[^\n]*)", docstring, re.M).group(1)
    command = shlex.split(line.replace("\\\n", " "))
    config = Path(command[command.index("--config_file") + 1]).stem
    return config, command[command.index("train.py") + 1:]


@pytest.fixture(scope="module")
def recipe_run(cached_run):
    """`recipe_run(recipe, config, *args)`: the recipe's documented command under `config` (its own, or single.yaml
    for the reference), with `args` added."""
    def run(recipe: str, config: str, *args: str) -> Path:
        return cached_run(config, *documented_launch(recipe)[1], *args)

    return run


def assert_same_run(reference: Path, run: Path) -> None:
    """Losses, learning rates and evaluations within the parity tolerance, at every step both logged."""
    differences = compare(reference, run, keys=PARITY_KEYS)
    assert len(differences) == 12 * 2 + 3  # loss and lr at every step, eval at the start, step 6 and the end
    assert worst_difference(differences).absolute <= LOSS_TOLERANCE, worst_difference(differences)


def from_scratch(config: str, base_model: Path) -> tuple[str, ...]:
    """The parity runs' settings (`parity_args`: 12 steps, global batch 12, clipping, checkpoints at 6 and 12)
    for a model the recipe builds itself."""
    return parity_args(config, base_model)[2:]


def test_a_plain_module_trains_under_ddp_as_on_one_process_and_rebuilds_from_final(recipe_run, base_model,
                                                                                   tmp_path) -> None:
    config, _ = documented_launch("plain_model")
    assert config == "ddp"
    reference, run = (recipe_run("plain_model", name, *from_scratch(name, base_model)) for name in ("single", config))
    assert_same_run(reference, run)
    assert_same_final_weights(reference, run, atol=1e-5)
    assert "model wrapped as DistributedDataParallel" in (run / "launch.log").read_text()
    assert json.loads((run / "summary.json").read_text())["model"] == "TinyLM"
    # final/: safetensors and what rebuilds the module, nothing from transformers
    assert sorted(p.name for p in (run / "final").glob("model*")) == ["model.json", "model.safetensors"]
    model = load_plain_model(run / "final")  # rebuilt from model.json, then its weights: the run's last evaluation
    assert type(model).__name__ == "TinyLM" and model.state_dict().keys() == load_file(run / "final" / "model.safetensors").keys()
    with torch.no_grad():
        sums = [token_loss_sums(model(batch["input_ids"]), batch["labels"])
                for batch in validation_batches(tmp_path, "recipes.plain_model:TinyLMTask")]
    final_eval = [m["eval_loss"] for m in read_metrics(run) if "eval_loss" in m][-1]
    assert float(sum(s.sum() for s, _ in sums) / sum(c.sum() for _, c in sums)) == pytest.approx(final_eval, rel=1e-5)
    assert "sample:          'Once upon a time" in (run / "launch.log").read_text()  # greedy text from the rebuilt model


@pytest.fixture(scope="module")
def npy_folder(base_model, tmp_path_factory) -> Path:
    """The core corpus's packed blocks, as the parity runs read them, written as .npy token arrays (3 files a split)."""
    model_args, data_args, args = parse_args([*TINY_RUN, "--model_name_or_path", str(base_model), "--output_dir",
                                              str(tmp_path_factory.mktemp("unused"))])
    task = build_task(model_args, data_args)
    raw = task.load_raw_datasets(args.seed)
    task.build_model(raw)
    folder = tmp_path_factory.mktemp("npy_tokens")
    for split, blocks in zip(("train", "validation"), task.build_datasets(raw, nullcontext())):
        (folder / split).mkdir()
        for i, part in enumerate(np.array_split(np.asarray(blocks["input_ids"]).reshape(-1), 3)):
            np.save(folder / split / f"{i}.npy", part.astype(np.int32))
    return folder


def test_npy_token_arrays_train_under_fsdp_what_the_core_corpus_trains(recipe_run, strategy_run, base_model,
                                                                        npy_folder) -> None:
    config, documented = documented_launch("npy_tokens")
    assert config == "fsdp" and "--dataset_name" in documented
    run = recipe_run("npy_tokens", config, *parity_args(config, base_model), "--dataset_name", str(npy_folder))
    assert "blocks of" in (run / "launch.log").read_text() and "from .npy files" in (run / "launch.log").read_text()
    assert_same_run(strategy_run("single"), run)  # the same blocks, read another way: the same training


def test_a_csv_classifier_trains_under_zero3_as_on_one_process_and_resumes_exactly(recipe_run, base_model,
                                                                                   tmp_path) -> None:
    config, _ = documented_launch("csv_classification")
    assert config == "deepspeed_zero3"
    reference, run = (recipe_run("csv_classification", name, *from_scratch(name, base_model))
                      for name in ("single", config))
    assert_same_run(reference, run)
    accuracy = [m["eval_accuracy"] for m in read_metrics(run) if "eval_accuracy" in m]
    assert accuracy[-1] > accuracy[0]  # it learns to tell the stories from the sums
    assert json.loads((run / "final" / "model.json").read_text())["kwargs"]["labels"] == ["arithmetic", "story"]

    shutil.copytree(run / "checkpoints" / "step_6", tmp_path / "checkpoints" / "step_6")
    train(config, tmp_path, *documented_launch("csv_classification")[1], *from_scratch(config, base_model),
          "--resume_from_checkpoint", "latest")
    assert_continues_exactly(run, tmp_path, from_step=6, last_step=12)


def test_label_smoothing_changes_training_under_ddp_not_evaluation(recipe_run, strategy_run, base_model) -> None:
    config, _ = documented_launch("label_smoothing")
    assert config == "ddp"
    reference, run = (recipe_run("label_smoothing", name, *parity_args(name, base_model)) for name in ("single", config))
    assert_same_run(reference, run)
    smoothed, plain = read_metrics(run), read_metrics(strategy_run("single"))
    assert [m["eval_loss"] for m in smoothed if m["step"] == 0] == [m["eval_loss"] for m in plain if m["step"] == 0]
    first_loss = [[m["loss"] for m in metrics if m["step"] == 1 and "loss" in m][0] for metrics in (smoothed, plain)]
    assert first_loss[0] > first_loss[1] + 0.01  # the same weights and batch: smoothing adds to the objective


def test_a_top5_metric_reaches_every_output_under_fsdp_and_changes_no_loss(recipe_run, strategy_run, base_model) -> None:
    config, _ = documented_launch("top5_accuracy")
    assert config == "fsdp"
    run = recipe_run("top5_accuracy", config, *parity_args(config, base_model), *SHOWN_FLAGS)
    assert_same_run(strategy_run("single"), run)
    top5 = [m["eval_top5_accuracy"] for m in read_metrics(run) if "eval_top5_accuracy" in m]
    accuracy = [m["eval_accuracy"] for m in read_metrics(run) if "eval_accuracy" in m]
    assert len(top5) == 3 and all(1 >= five >= one > 0 for five, one in zip(top5, accuracy))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_top5_accuracy"] == top5[-1] and summary["eval_top5_accuracy_at_start"] == top5[0]
    assert f"eval_top5_accuracy {top5[-1]:.4f}" in (run / "launch.log").read_text()  # the console summary
    assert (run / "report.png").is_file() == installed("report")  # its panel: tests/test_report.py draws one per eval_* metric


@pytest.mark.quick
@pytest.mark.parametrize("recipe", ["plain_model", "npy_tokens", "csv_classification", "label_smoothing", "top5_accuracy"])
def test_the_docs_quote_each_recipe_as_it_is(recipe: str) -> None:
    """docs/recipes.md shows each recipe's command and code; every quoted block is in the file, verbatim."""
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    section = DOCS.split(f"recipes/{recipe}.py")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks and all(block in source for block in blocks), recipe
    config, args = documented_launch(recipe)
    assert f"--config_file accelerate_configs/{config}.yaml train.py {args[0]} {args[1]}" in DOCS


@pytest.mark.quick
@pytest.mark.parametrize(("argv", "message"), [
    (["--task", "recipes.no_such_file:Task"], r"--task recipes.no_such_file:Task: cannot import it \(No module named"),
    (["--task", "recipes.top5_accuracy:NoSuchTask"], "--task recipes.top5_accuracy:NoSuchTask: cannot import it"),
    (["--task", "recipes.plain_model:TinyLM"], "--task recipes.plain_model:TinyLM is not a Task subclass"),  # the model
    (["--task", "recipes.label_smoothing:SMOOTHING"], "--task recipes.label_smoothing:SMOOTHING is not a Task subclass"),
    (["--task", "recipes.csv_classification:CsvClassification", "--block_size", "64"], "--block_size is for --task causal-lm"),
])
def test_a_task_given_as_module_and_class_is_checked_like_a_registered_one(tmp_path, argv, message) -> None:
    with pytest.raises(ArgumentError, match=message):
        parse_args([*argv, "--output_dir", str(tmp_path)])


@pytest.mark.quick
def test_a_subclass_of_a_registered_task_takes_its_configs_and_flags(tmp_path) -> None:
    model_args, data_args, _ = parse_args(["--task", "recipes.label_smoothing:LabelSmoothedLM", "--block_size", "64",
                                           "--output_dir", str(tmp_path)])
    assert (model_args.model_config, data_args.block_size) == ("llama-small", 64)  # causal-lm's default config
    (tmp_path / "train.csv").write_text("text,label\nTwo plus two is four.,arithmetic\n")
    _, data_args, _ = parse_args(["--task", "recipes.csv_classification:CsvClassification", "--train_file",
                                  str(tmp_path / "train.csv"), "--output_dir", str(tmp_path)])  # one of its own_flags
    assert data_args.train_file == str(tmp_path / "train.csv")


@pytest.mark.quick
@pytest.mark.parts("sft")
def test_a_subclass_of_a_parts_task_is_that_task_not_the_core_one(tmp_path, monkeypatch) -> None:
    """The registered task nearest in the class's ancestry decides: sft's subclass is sft (itself a CausalLM)."""
    (tmp_path / "my_chat_task.py").write_text("from parts.sft.task import SupervisedFineTuning\n\n\n"
                                              "class MyChat(SupervisedFineTuning):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model_args, data_args, _ = parse_args(["--task", "my_chat_task:MyChat", "--max_length", "64", "--output_dir",
                                           str(tmp_path / "out")])
    assert data_args.parts.sft.max_length == 64  # sft's own flag, refused for causal-lm
    with pytest.raises(ArgumentError, match="--block_size is for --task causal-lm"):
        parse_args(["--task", "my_chat_task:MyChat", "--block_size", "64", "--output_dir", str(tmp_path / "out")])


@pytest.mark.quick
def test_a_schedule_of_your_own_is_transformers_warmup_stable_decay_through_the_part_hook(monkeypatch) -> None:
    """recipes/wsd_schedule.py installed as a part: the core's scheduler gives, at every step of a 100-step run with
    10 warmup steps, `get_wsd_schedule`'s rate (1-sqrt over the last 20); --lr_scheduler_type given beside it is
    refused. The docs quote the hook verbatim."""
    from types import SimpleNamespace

    from transformers.optimization import get_wsd_schedule

    import training.parts
    from recipes.wsd_schedule import PART, WsdFlags
    from training.errors import ArgumentError
    from training.optim import build_scheduler
    from training.parts import InstalledParts

    monkeypatch.setattr(training.parts, "parts", lambda: InstalledParts([PART]))
    args = SimpleNamespace(parts=SimpleNamespace(wsd=WsdFlags(0.2)), warmup_steps=10, lr_scheduler_type="cosine",
                           lr_scheduler_kwargs={}, given=frozenset({"wsd_decay_fraction", "warmup_steps"}))

    def rates(scheduler) -> list[float]:
        seen = []
        for _ in range(100):
            seen.append(scheduler.get_last_lr()[0])
            scheduler.optimizer.step()
            scheduler.step()
        return seen

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)

    ours = rates(build_scheduler(optimizer(), args, 100))
    theirs = rates(get_wsd_schedule(optimizer(), num_warmup_steps=10, num_stable_steps=70, num_decay_steps=20,
                                    decay_type="1-sqrt"))
    assert ours == theirs and ours[50] == ours[80] == 2.0 and ours[-1] < ours[81] < 2.0
    with pytest.raises(ArgumentError, match="--lr_scheduler_type and --lr_scheduler_kwargs with a part's own schedule"):
        build_scheduler(optimizer(), SimpleNamespace(**vars(args) | {"given": args.given | {"lr_scheduler_type"}}), 100)
    source, section = (REPO / "recipes" / "wsd_schedule.py").read_text(), DOCS.split("recipes/wsd_schedule.py")[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks and all(block in source for block in blocks)
