"""The README and docs/ work as written: every command on the front page parses, every link
resolves, the first-hour walkthrough (check the launch, train with a tracker,
find the report picture) runs, and the model-config example builds a model."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import torch
from accelerate.commands.launch import launch_command_parser
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM
from transformers.trainer_utils import SchedulerType

from models.configs import NAMED_CONFIGS, build_named_config
from models.language import build_tokenizer
from tests.harness import REPO, SHOWN_FLAGS, TINY_RUN, launch
from training.arguments import ArgumentError, check_task_flags, read_flags
from training.parts import installed

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
GETTING_STARTED = (DOCS / "getting-started.md").read_text()
MODELS_AND_DATA = (DOCS / "models-and-data.md").read_text()
MARKDOWN_FILES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
FENCED_BLOCK = re.compile(r"^ *```.*?^ *```", re.MULTILINE | re.DOTALL)


def code_block_after(marker: str, language: str, text: str = README) -> str:
    """The first ```language block after `marker` in `text` (the README unless given)."""
    return re.search(rf"{re.escape(marker)}.*?```{language}\n(.*?)```", text, re.DOTALL).group(1)


def test_the_first_hour_check_train_with_a_tracker_and_open_the_report(tmp_path) -> None:
    check_line, train_line, tensorboard_line = code_block_after("## Your first hour", "bash", GETTING_STARTED).strip().splitlines()
    train = shlex.split(train_line)
    assert shlex.split(check_line) == [*train, "--dry_run"]  # the same launch, checked first
    config = train[train.index("--config_file") + 1]
    output_dir = Path(train[train.index("--output_dir") + 1])
    assert tensorboard_line == f"tensorboard --logdir {output_dir}/runs"
    # The same commands, shortened for CI: the tiny model, 6 steps, into a scratch directory.
    args = [*train[train.index("train.py") + 1:], *TINY_RUN, *SHOWN_FLAGS, "--max_steps", "6", "--output_dir",
            str(tmp_path / "run")]
    checked = launch(REPO / config, "train.py", *args, "--dry_run")
    assert checked.returncode == 0 and "===== dry run: checked, nothing trained =====" in checked.stdout, checked.stderr[-3000:]
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").iterdir())
    result = launch(REPO / config, "train.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]

    events = EventAccumulator(str(tmp_path / "run" / "runs" / "run"))
    events.Reload()
    assert "loss" in events.Tags()["scalars"]
    if installed("report"):  # the report part: the run drew its picture
        assert imread(tmp_path / "run" / "report.png").shape == (800, 1800, 4)
    first_hour = GETTING_STARTED.split("## Your first hour")[1].split("\n## ")[0]
    picture = re.search(r"!\[[^]]*\]\(([^)]+)\)", first_hour).group(1)  # the example report shown there
    assert imread(DOCS / picture).shape == (800, 1800, 4)


@pytest.mark.quick
def test_the_new_architecture_example_builds_and_runs(monkeypatch) -> None:
    configs = dict(NAMED_CONFIGS)  # the example adds to it; the real registry stays as it is
    monkeypatch.setattr("models.configs.NAMED_CONFIGS", configs)
    exec(code_block_after("## A new architecture from scratch", "python", MODELS_AND_DATA), {"NAMED_CONFIGS": configs})
    tokenizer = build_tokenizer(None, None)
    model = AutoModelForCausalLM.from_config(build_named_config("qwen2-small", tokenizer))
    logits = model(input_ids=torch.tensor([tokenizer("Once upon a time").input_ids])).logits
    assert logits.shape[-1] == model.config.vocab_size >= len(tokenizer)


# ---- the front page: every command parses ---------------------------------------------------

COMMAND_START = re.compile(r"^([A-Z_][A-Z0-9_]*=\S+ )*(accelerate launch|python3?|make|sbatch|pip) ")


def section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n")[1].split("\n## ")[0]


def recipe_commands() -> list[str]:
    """The recipes table: one row per recipe, its second cell exactly one command."""
    rows = re.findall(r"^\|(.+)\|$", section(README, "## Recipes"), re.MULTILINE)[2:]  # after the header and rule
    commands = []
    for row in rows:
        cell = row.split("|")[1].strip()
        command = re.fullmatch(r"`([^`]+)`", cell)
        assert command and COMMAND_START.match(command.group(1)), f"not one command: {row}"
        commands.append(command.group(1))
    return commands


def front_page_commands() -> list[str]:
    """Every line of the README's bash blocks, and every inline `code` that is a command."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", README, re.MULTILINE | re.DOTALL):
        commands += [line for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]
    prose = FENCED_BLOCK.sub("", README)
    commands += [code for code in re.findall(r"`([^`\n]+)`", prose) if COMMAND_START.match(code)]
    return commands


def parse_launcher(argv: list[str]):
    """`accelerate launch`'s own parser: real launcher flags only, no abbreviations."""
    parser = launch_command_parser()
    parser.allow_abbrev = False

    def error(message: str):
        pytest.fail(f"accelerate launch {shlex.join(argv)}: {message}")

    parser.error = error
    return parser.parse_args(argv)


def check_train_args(argv: list[str]) -> None:
    """train.py's flags parse with its own parser (no unknown flag, no bad choice), without training."""
    try:
        model_args, data_args, train_args = read_flags(argv)
    except ArgumentError as error:
        pytest.fail(f"train.py {shlex.join(argv)}: {error}")
    assert train_args.lr_scheduler_type in {s.value for s in SchedulerType}
    check_task_flags(model_args, data_args)  # the named config and every flag given belong to --task


def check_script_args(script: Path, argv: list[str]) -> None:
    """A script of the repository exists, and its own parser takes the arguments, if it has one."""
    assert script.is_file(), script
    spec = importlib.util.spec_from_file_location(f"readme_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "parse_args"):
        try:
            module.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{script.name} {shlex.join(argv)} does not parse")


def check_command(command: str) -> None:
    words = shlex.split(command, comments=True)
    segments, current = [], []
    for word in [*words, "&&"]:
        if word == "&&":
            segments.append(current)
            current = []
        else:
            current.append(word)
    for segment in segments:
        env = {}
        while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", segment[0]):
            name, value = segment.pop(0).split("=", 1)
            env[name] = value
        segment = [re.sub(r"^\$\{?\w+\}?$", "0", word) for word in segment]  # $NODE_RANK, $HEAD_NODE_IP: placeholders
        program, *argv = segment
        if program == "accelerate":
            assert argv[0] == "launch", command
            launcher = parse_launcher(argv[1:])
            if launcher.config_file:
                assert (REPO / launcher.config_file).is_file(), launcher.config_file
            assert (REPO / launcher.training_script).is_file(), launcher.training_script
            if launcher.training_script == "train.py":
                check_train_args(launcher.training_script_args)
        elif program in ("python", "python3") and argv[:2] == ["-m", "venv"]:
            assert argv[2:] == [".venv"], command
        elif program in ("python", "python3") and argv[:2] == ["-m", "pytest"]:
            markers = re.findall(r"(?:^| )-m (\w+)", shlex.join(argv[2:]))
            for marker in markers:  # a marker pytest.ini registers
                assert re.search(rf"^\s+{marker}:", (REPO / "pytest.ini").read_text(), re.MULTILINE), marker
        elif program in ("python", "python3"):
            check_script_args(REPO / argv[0], argv[1:])
        elif program == ".":
            assert argv == [".venv/bin/activate"], command
        elif program == "pip":
            assert argv[:2] == ["install", "-r"] and (REPO / argv[2]).is_file(), command
        elif program == "make":
            for target in argv:
                assert re.search(rf"^{re.escape(target)}:", (REPO / "Makefile").read_text(), re.MULTILINE), target
        elif program == "sbatch":
            script = next(i for i, word in enumerate(argv) if word.endswith(".sbatch"))
            assert (REPO / argv[script]).is_file(), argv[script]
            check_train_args(argv[script + 1:])
            scripts = "".join(path.read_text() for path in (REPO / "scripts" / "slurm").iterdir())
            for name, value in env.items():  # variables the SLURM scripts read, with paths that exist
                assert name in scripts, name
                if "/" in value:
                    assert (REPO / value).is_file(), value
        else:
            pytest.fail(f"unknown program in {command!r}")


@pytest.mark.quick
def test_every_command_on_the_front_page_parses() -> None:
    recipes = recipe_commands()
    assert len(recipes) >= 9  # text data, ZeRO-3, FSDP2, multi-node, SLURM, your own model, optimizer, resume, ...
    joined = "\n".join(recipes)
    for needed in ("--train_file", "deepspeed_zero3.yaml", "fsdp.yaml", "--num_machines", "--machine_rank",
                   "--main_process_ip", "scripts/slurm/train.sbatch", "--optim", "--learning_rate",
                   "--lr_scheduler_type", "--warmup_ratio", "--resume_from_checkpoint latest",
                   *(["--task recipes."] if installed("recipes") else [])):  # (a fork may leave the examples out)
        assert needed in joined, needed
    commands = front_page_commands()
    assert set(recipes) <= set(commands)
    for command in commands:
        check_command(command)
    # The two commands of the quick start: the test command is the one CI runs.
    setup_and_train, setup_and_test = [block.strip() for block in re.findall(
        r"^```bash\n(.*?)^```", section(README, "## Quick start"), re.MULTILINE | re.DOTALL)][:2]
    assert setup_and_train.endswith("&& accelerate launch train.py")
    # CI runs exactly that line (nothing appended: no -k, no --deselect), after changing to the repository root
    ci_commands = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
                   if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci_commands == [setup_and_test]
    assert len(README.splitlines()) <= 150  # a front page; the rest lives in docs/ (the optional parts' measurements on their pages)


# ---- links: every relative link resolves, to a file and a heading ----------------------------

def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped (not '-' or '_'), spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCED_BLOCK.sub("", path.read_text()), re.MULTILINE):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")  # GitHub numbers repeats
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def links(path: Path) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", FENCED_BLOCK.sub("", path.read_text()))


@pytest.mark.quick
def test_every_link_in_the_readme_and_docs_resolves() -> None:
    checked = 0
    for page in MARKDOWN_FILES:
        for target in links(page):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.is_relative_to(REPO) and resolved.exists(), f"{page.name}: {target}"
            if anchor:
                assert resolved.suffix == ".md" and anchor in anchors(resolved), f"{page.name}: {target}"
            checked += 1
    assert checked > 50
    linked = {(REPO / target.partition("#")[0]).resolve() for target in links(REPO / "README.md")}
    assert set(DOCS.glob("*.md")) <= linked  # the front page links every doc


@pytest.mark.quick
@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda page: page.name)
def test_every_doc_opens_with_its_table_of_contents(page: Path) -> None:
    text = FENCED_BLOCK.sub("", page.read_text())
    top, _, body = text.partition("\n## ")
    headings = [github_anchor(heading) for heading in re.findall(r"^## (.+)$", "## " + body, re.MULTILINE)]
    assert re.findall(r"\]\(#([^)]+)\)", top) == headings
