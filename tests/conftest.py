"""The suite's fixtures and hooks: runs that several modules read, trained once per test run by whichever worker
needs one first, in a directory both workers share (`made_once`); what a project without a part deselects; and
each installed part's own fixtures (tests/fixtures/<part>.py). The launches themselves: tests/harness.py.

The suite runs on two pytest-xdist workers (pytest.ini), each module's tests on one worker.
"""

from __future__ import annotations

from tests import harness  # isort: skip - first: it hides the GPUs from torch, which the imports below load

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests import forked_launcher
from tests.harness import REPO, SPLITS, gpu_count, made_once, parity_args, split_args, train, variable_length_documents
from training.parts import installed_parts

# Each installed part's fixtures (tests/fixtures/<part>.py), as pytest plugins: a project without the part has neither.
PART_FIXTURES = [f"tests.fixtures.{part.name}" for part in installed_parts()
                 if (REPO / "tests" / "fixtures" / f"{part.name}.py").is_file()]
pytest_plugins = PART_FIXTURES


def pytest_configure(config: pytest.Config) -> None:
    """Build DeepSpeed's CPU Adam (ZeRO offload's optimizer) in the background as the suite starts.

    It is compiled once per machine (TORCH_EXTENSIONS_DIR), which takes a minute or two: the README's
    test command builds it before the suite (scripts/build_cpu_adam.py), and then this load takes a
    second. Without that, built inside the first offload run, it held that run, and every test
    waiting for it. Only
    the xdist controller (or a run without xdist) starts it, and only for the whole suite (no -m
    selection such as the quick tier, which needs no offload); a later load waits for a build in
    progress (torch's lock) or finds it done. First, the installed parts' flags for every run (`SUITE_FLAGS`, and
    `SHOWN_FLAGS` for a run whose outputs a test looks at, `PARITY_FLAGS` for the parity runs) join tests/harness.py's."""
    for name in PART_FIXTURES:
        module = importlib.import_module(name)
        harness.SUITE_FLAGS.extend(getattr(module, "SUITE_FLAGS", ()))
        harness.SHOWN_FLAGS.extend(getattr(module, "SHOWN_FLAGS", ()))
        harness.PARITY_FLAGS.extend(getattr(module, "PARITY_FLAGS", ()))
    harness.TINY_RUN.extend(harness.SUITE_FLAGS)
    if hasattr(config, "workerinput") or config.option.collectonly or config.option.markexpr:
        return
    subprocess.Popen([sys.executable, "scripts/build_cpu_adam.py"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures: whether its launches (and those of the runs it trains first) are forked."""
    harness.FORKED = item.get_closest_marker("forked") is not None


def pytest_unconfigure(config: pytest.Config) -> None:
    if forked_launcher.rank_records.cache_info().currsize:
        shutil.rmtree(forked_launcher.rank_records(), ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests that need a part this project does not hold (`@pytest.mark.parts(...)`: a fork made by
    scripts/new_project.py; here every part is installed and nothing is deselected), and the `nightly` ones unless
    `-m` names them. Skip the `gpu` tests on a machine without a GPU (`pytest -m gpu` then skips them all)."""
    from training.parts import installed_parts

    installed = {part.name for part in installed_parts()}
    nightly = "nightly" in (config.option.markexpr or "")
    deselected = [item for item in items if not {name for mark in item.iter_markers("parts") for name in mark.args} <= installed
               or ("nightly" in item.keywords and not nightly)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if gpu_tests and gpu_count() == 0:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; this machine has none"))


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    """llama-tiny with the embedded tokenizer, on CPU."""
    from transformers import AutoModelForCausalLM

    from models.configs import build_named_config
    from models.language import build_tokenizer

    return AutoModelForCausalLM.from_config(build_named_config("llama-tiny", build_tokenizer(None, None)))


@pytest.fixture
def text_documents() -> list[str]:
    """Enough short documents for a few blocks of 32 tokens."""
    return [f"Document {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(200)]


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this test run shares (the session's temp dir without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def cached_run(shared_dir):
    """`cached_run(config, *args, fresh=False, launcher_args=())` trains once per distinct (config, args, fresh,
    launcher_args) in the test run."""

    def trained(config: str | Path, args: tuple[str, ...], fresh: bool,
                launcher_args: tuple[str, ...]) -> Callable[[Path], None]:
        def make(output_dir: Path) -> None:
            result = train(config, output_dir, *args, fresh=fresh, launcher_args=launcher_args)
            (output_dir / "launch.log").write_text(result.stdout + result.stderr)

        return make

    def run(config: str | Path, *args: str, fresh: bool = False, launcher_args: tuple[str, ...] = ()) -> Path:
        launch_key = [*(["fresh"] if fresh else []), *(["launcher", *launcher_args] if launcher_args else [])]
        key = hashlib.sha256(json.dumps([str(config), *args, *launch_key]).encode()).hexdigest()[:16]
        return made_once(shared_dir / "runs" / key, trained(config, args, fresh, launcher_args))

    return run


@pytest.fixture(scope="session")
def bf16_run(cached_run):
    """`bf16_run(config, *flags)`: 8 steps launched with --mixed_precision bf16 (autocast on CPU), trained once per
    test run: bf16 parameters and the fused loss compare with the same runs."""
    steps = ("--max_steps", "8", "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no")
    return lambda config, *flags: cached_run(config, *steps, *flags, launcher_args=("--mixed_precision", "bf16"))


@pytest.fixture(scope="session")
def uneven_data(shared_dir) -> list[str]:
    """Flags for 50 training and 13 validation documents of different lengths, unpacked and padded."""

    def write(directory: Path) -> None:
        for name, count, seed in (("train", 50, 1), ("validation", 13, 2)):
            lines = [json.dumps({"text": text}) for text in variable_length_documents(count, seed)]
            (directory / f"{name}.jsonl").write_text("\n".join(lines))

    directory = made_once(shared_dir / "uneven_data", write)
    return ["--train_file", str(directory / "train.jsonl"), "--validation_file", str(directory / "validation.jsonl"),
            "--packing", "false", "--block_size", "64"]


@pytest.fixture(scope="session")
def split_run(cached_run, uneven_data):
    """`split_run(name)`: the run for one entry of SPLITS, trained once per test run."""
    def run(name: str):
        config, per_device, accumulation = SPLITS[name]
        return cached_run(config, *split_args(uneven_data, per_device, accumulation))

    return run


@pytest.fixture(scope="session")
def base_model(cached_run) -> Path:
    """A checkpoint the suite trains first (12 steps of llama-tiny on the story corpus), in Hub format:
    what the fine-tuning runs start from."""
    return cached_run("single", "--max_steps", "12", "--eval_strategy", "no", "--save_strategy", "no") / "final"


@pytest.fixture(scope="session")
def strategy_run(cached_run, base_model):
    """`strategy_run(config)`: the parity run of one config, trained once per test run, by a fresh launch (new
    interpreters, the user's environment): the promise itself, and every config file's launch as a user runs it.

    The shipped DeepSpeed JSONs leave clipping "auto", so the flag alone changes it on every config."""
    return lambda config: cached_run(config, *parity_args(config, base_model), fresh=True)


@pytest.fixture(scope="session")
def tied_base_model(base_model, shared_dir) -> Path:
    """`base_model` as many small published models are: its output layer tied to the input embedding,
    saved in bf16 (train.py loads it in fp32): a tied model's training, checkpoints and export, from a pretrained one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def make(directory: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(base_model)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.get_input_embeddings().weight
        model.to(torch.bfloat16).save_pretrained(directory)
        AutoTokenizer.from_pretrained(base_model).save_pretrained(directory)

    return made_once(shared_dir / "tied_base_model", make)


