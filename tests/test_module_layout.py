"""One home per concern stays true as the project grows: training/ imports no module in a circle, and
every module says what it owns. (A module may be long when it has one job: there is no line cap.)"""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO
from training.parts import installed_parts

pytestmark = pytest.mark.quick
MODULES = sorted((REPO / "training").glob("*.py"))


def imported_training_modules(path) -> set[str]:
    """The training.* modules `path` imports, at the top or inside functions alike."""
    return {node.module.split(".")[1] for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("training.")}


def test_training_has_no_import_circle() -> None:
    graph = {path.stem: imported_training_modules(path) for path in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import circle: {' -> '.join([*path[path.index(module):], module])}"
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])


@pytest.mark.parametrize("path", [REPO / "train.py", *MODULES, *sorted((REPO / "parts").rglob("*.py"))],
                         ids=lambda path: str(path.relative_to(REPO)))
def test_each_module_opens_with_what_it_owns(path) -> None:
    assert ast.get_docstring(ast.parse(path.read_text())), "each module opens with a docstring saying what it owns"


def test_no_core_module_names_a_part() -> None:
    """A fork deletes a part's folder and the core still imports: only training/parts.py finds the parts, by
    listing parts/ (and the parts' own modules import them)."""
    core = [REPO / "train.py", *MODULES, *(REPO / "data").glob("*.py"), *(REPO / "models").glob("*.py")]
    for path in core:
        imported = {node.module for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module}
        assert not {module for module in imported if module.split(".")[0] == "parts"}, path.name


def test_the_layout_page_shows_the_measured_lines_of_the_core_and_each_part() -> None:
    from scripts.count_lines import counts, table

    assert table() in (REPO / "docs" / "layout.md").read_text(), "run python scripts/count_lines.py --write"
    assert set(counts()) == {"core", *(f"parts/{part.name}" for part in installed_parts())}  # every part counted


def test_the_counted_code_keeps_two_blank_lines_before_each_top_level_definition() -> None:
    """The line count is only a fair measure if the code keeps PEP 8's layout (E302): two blank lines before each
    top-level function or class that follows other code, comments directly above it included."""
    from scripts.count_lines import CORE

    counted = [REPO / "train.py", *(path for name in [*CORE[1:], "parts"] for path in sorted((REPO / name).rglob("*.py")))]
    for path in counted:
        lines = path.read_text().splitlines()
        for node in ast.parse("\n".join(lines)).body[1:]:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)]) - 1
                while first > 0 and lines[first - 1].lstrip().startswith("#"):
                    first -= 1
                assert lines[max(first - 2, 0):first] == ["", ""], f"{path.relative_to(REPO)}:{first + 1}"
