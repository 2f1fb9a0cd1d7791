"""scripts/new_project.py: a project holding the core alone, or the core and two parts, that stands on its own.

Each fork is made as a user makes it (the script, a new interpreter), and then checked in its own directory:
every test module of its suite imports and collects (no test needs a part it lacks: `@pytest.mark.parts`
deselects those), its pages and shared fixtures name no part it left out, its quick tier passes (the core
alone's whole tier; the two parts' fork, their modules and its checks of docs and flags), and its default
job trains.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from tests.harness import REPO, launch_command
from training.parts import installed_parts

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)



@dataclass
class Empty:
    """A part without flags."""


def make(destination: Path, *keep: str) -> Path:
    result = subprocess.run([sys.executable, "scripts/new_project.py", str(destination), *(["--keep", ",".join(keep)] if keep else [])],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return destination


def pytest_in(fork: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *args], cwd=fork,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def minimal(tmp_path_factory) -> Path:
    return make(tmp_path_factory.mktemp("forks") / "minimal")


@pytest.mark.quick
def test_list_names_every_part_first_on_its_line() -> None:
    listed = subprocess.run([sys.executable, "scripts/new_project.py", "--list"], cwd=REPO, capture_output=True,
                            text=True, timeout=60).stdout.splitlines()
    assert [line.split()[0] for line in listed] == [part.name for part in installed_parts()]
    assert all(len(line.split(maxsplit=1)) == 2 for line in listed)  # and what it does


def test_the_core_alone_collects_passes_its_checks_and_trains(minimal, tmp_path) -> None:
    assert [path.name for path in (minimal / "parts").iterdir() if path.is_dir()] == []
    requirements = (minimal / "requirements.txt").read_text()
    assert "peft==" not in requirements and "torchdata==" not in requirements and "torch==" in requirements
    assert not (minimal / "docs" / "images.md").exists() and not (minimal / "tests" / "test_images.py").exists()
    assert not re.search(r"\]\(docs/(images|sft|lora|pipeline)\.", (minimal / "README.md").read_text())
    lines = re.search(r"\| `core` \| ([\d,]+) \|", (minimal / "docs" / "layout.md").read_text()).group(1)
    assert not re.search(r"\| `parts/\w+` \| [\d,]+ \|", (minimal / "docs" / "layout.md").read_text())  # no part's lines
    assert int(lines.replace(",", "")) > 1000

    assert not (minimal / "scripts" / "new_project.py").exists() and not (minimal / "tests" / "test_new_project.py").exists()
    for part in installed_parts():  # its pages and its tests' shared fixtures name no part it left out
        names = [rf"parts/{part.name}\b", rf"\]\((docs/)?{part.name}\.md", *(rf"--{flag.name}\b" for flag in
                                                                            fields(part.flags or Empty))]
        for page in [minimal / "README.md", *sorted((minimal / "docs").glob("*.md")), minimal / "tests" / "conftest.py"]:
            found = re.search("|".join(names), page.read_text())
            assert not found, f"{page.relative_to(minimal)} names the part {part.name}: {found.group(0)}"

    collected = pytest_in(minimal, "--collect-only")
    assert collected.returncode == 0, collected.stdout[-3000:]
    assert re.search(r"(\d+) deselected", collected.stdout), collected.stdout[-500:]  # the tests that need a part
    checks = pytest_in(minimal, "-m", "quick")  # its whole quick tier
    assert checks.returncode == 0 and " passed" in checks.stdout, checks.stdout[-3000:]

    command, env = launch_command("single", "train.py", "--model_config", "llama-tiny", "--max_steps", "3",
                                  "--max_eval_samples", "8", "--output_dir", str(tmp_path / "run"),
                                  fresh=True)
    trained = subprocess.run(command, cwd=minimal, env=env, capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


@pytest.mark.parts("sft", "lora")  # a project without them cannot keep them
def test_two_parts_come_with_their_tests_flags_and_pages(tmp_path) -> None:
    fork = make(tmp_path / "two", "sft", "lora")
    assert sorted(path.name for path in (fork / "parts").iterdir() if path.is_dir()) == ["lora", "sft"]
    assert "peft==" in (fork / "requirements.txt").read_text() and (fork / "docs" / "sft.md").exists()
    collected = pytest_in(fork, "--collect-only")
    assert collected.returncode == 0, collected.stdout[-3000:]
    checks = pytest_in(fork, "-m", "quick", "tests/test_sft.py", "tests/test_readme.py", "tests/test_arguments.py")
    assert checks.returncode == 0 and " passed" in checks.stdout, checks.stdout[-3000:]


@pytest.mark.quick
def test_a_part_comes_with_the_parts_it_builds_on(tmp_path) -> None:
    """dpo builds on sft's chat formats (`Part.needs`): kept alone it is refused, naming the --keep that works."""
    result = subprocess.run([sys.executable, "scripts/new_project.py", str(tmp_path / "dpo"), "--keep", "dpo"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and not (tmp_path / "dpo").exists()
    assert result.stderr.strip() == "error: the parts kept build on sft (`Part.needs`); keep it too (--keep dpo,sft)"


@pytest.mark.quick
@pytest.mark.parts("dpo", "distillation")
def test_a_file_two_parts_own_stays_while_either_is_kept(tmp_path) -> None:
    """The frozen model's placement and record serve DPO's reference and distillation's teacher (both name them in
    `Part.files`): a project keeping one of the two keeps them, the core alone has neither."""
    shared = ("training/strategy/frozen.py", "training/checkpoints/frozen.py")
    assert all(path in part.files for part in installed_parts() if part.name in ("dpo", "distillation")
               for path in shared)
    teacher, core = make(tmp_path / "teacher", "distillation"), make(tmp_path / "core")
    assert all((teacher / path).is_file() and not (core / path).exists() for path in shared)
    assert not (teacher / "parts" / "dpo").exists()
