"""One home per concern stays true as the project grows: training/ imports no module in a circle, and
every module says what it owns. (A module may be long when it has one job: there is no line cap.)"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import pytest

from tests.harness import REPO
from training.errors import ArgumentError
from training.parts import HOOKS, Combine, Flags, InstalledParts, Part, installed_parts, parts

pytestmark = pytest.mark.quick
MODULES = sorted((REPO / "training").rglob("*.py"))


PACKAGES = ("training", "data", "models", "parts")


def module_name(path) -> str:
    """`path`'s dotted module name (a package's `__init__.py`: the package's)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path, known: set[str]) -> set[str]:
    """The `known` modules `path` imports, at the top or inside functions alike (`from a import b` imports `a`, and `a.b`
    where that is a module); not those it names for type annotations only (`if TYPE_CHECKING:`, never imported)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test) ==
                   "TYPE_CHECKING" for statement in block.body for node in ast.walk(statement)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & known - {module_name(path)}


def test_no_import_circle() -> None:
    """No module of the core or the parts imports itself back through others, counting imports inside functions (data
    never reaches up into the task registry; a part's package and its modules import one way)."""
    paths = [path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))]
    known = {module_name(path) for path in paths}
    graph = {module_name(path): imported_modules(path, known) for path in paths}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import circle: {' -> '.join([*path[path.index(module):], module])}"
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
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


def test_the_pages_hold_the_rows_of_the_parts_installed_and_the_measured_lines() -> None:
    """docs/layout.md's lines of Python and what each part does, the README's list of the parts' pages, and
    docs/train-py.md's flags of each part: each as scripts/part_tables.py writes it from the parts themselves."""
    from scripts.part_tables import BLOCK, PAGES, counts, written

    for name in PAGES:
        page = (REPO / name).read_text()
        assert BLOCK.search(page), f"{name} has no block of parts' rows"
        assert written(page, REPO, installed_parts()) == page, "run python scripts/part_tables.py --write"
    assert set(counts()) == {"core", *(f"parts/{part.name}" for part in installed_parts())}  # every part counted
    layout = (REPO / "docs" / "layout.md").read_text()
    assert all(f"| `parts/{part.name}` |" in layout for part in installed_parts())


def test_the_counted_code_keeps_two_blank_lines_before_each_top_level_definition() -> None:
    """The line count is only a fair measure if the code keeps PEP 8's layout (E302): two blank lines before each
    top-level function or class that follows other code, comments directly above it included."""
    from scripts.part_tables import CORE

    counted = [REPO / "train.py", *(path for name in [*CORE[1:], "parts"] for path in sorted((REPO / name).rglob("*.py")))]
    for path in counted:
        lines = path.read_text().splitlines()
        for node in ast.parse("\n".join(lines)).body[1:]:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)]) - 1
                while first > 0 and lines[first - 1].lstrip().startswith("#"):
                    first -= 1
                assert lines[max(first - 2, 0):first] == ["", ""], f"{path.relative_to(REPO)}:{first + 1}"


def test_a_part_defines_hooks_only() -> None:
    """Every method of a part is one of `Part`'s hooks, typed, documented and combined there (helpers live in the
    part's modules): a part class that defines another method is refused as it is defined."""
    with pytest.raises(TypeError, match=r"^Mine\.prepare_things is not a hook of Part \(training/parts.py\)"):
        class Mine(Part):
            def check_flags(self, flags: Flags) -> None:
                pass

            def prepare_things(self) -> None:
                pass
    for part in installed_parts():
        assert isinstance(part, Part) and part.name and part.description
        methods = {name for name, value in vars(type(part)).items() if callable(value) and not name.startswith("__")
                   and not isinstance(value, type)}
        assert methods <= set(HOOKS), (part.name, methods - set(HOOKS))


def test_no_hook_is_called_by_its_name_as_a_string() -> None:
    """The core calls `parts().<hook>(context)`: a reader goes from the call to the hook's one definition."""
    core = [REPO / "train.py", *MODULES, *(REPO / "data").glob("*.py"), *(REPO / "models").glob("*.py")]
    for path in core:
        strings = {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)}
        assert not strings & set(HOOKS), (path.name, strings & set(HOOKS))


def test_parts_run_after_the_parts_they_name() -> None:
    """A wrapper of the training objective goes around what replaces it, and compilation around both."""
    order = [part.name for part in installed_parts()]
    for part in installed_parts():
        assert all(order.index(name) < order.index(part.name) for name in part.after if name in order), part.name
    wrappers = [name for name in ("distillation", "bf16_params", "compile") if name in order]
    assert sorted(wrappers, key=order.index) == wrappers


def test_each_hook_combines_the_parts_answers_as_it_declares() -> None:
    calls = []

    class First(Part):
        name = "first"

        def check_flags(self, flags):
            calls.append(self.name)

        def wrap_model(self, model, run):
            return f"{self.name}({model})"

        def loader_settings(self, args):
            return {"num_workers": 1, "pin_memory": True}

        def started(self, run):
            return None

        def checkpoint_layout(self, args):
            return {}

    class Second(First):
        name = "second"

        def loader_settings(self, args):
            return {"num_workers": 2}

        def checkpoint_layout(self, args):
            return {"schedule": "1F1B", "stages": [0, 2]}  # any JSON value

        def started(self, run):
            return "a line"

    both = InstalledParts([First(), Second()])
    assert (HOOKS["check_flags"], HOOKS["wrap_model"], HOOKS["loader_settings"], HOOKS["started"]) == (
        Combine.EACH, Combine.CHAIN, Combine.MERGE, Combine.ANSWERS)
    assert both.check_flags(None) is None and calls == ["first", "second"]
    assert both.wrap_model("model", None) == "second(first(model))"
    assert both.loader_settings(None) == {"num_workers": 2, "pin_memory": True}
    assert both.started(None) == ["a line"]
    assert HOOKS["checkpoint_layout"] is Combine.BY_PART
    assert both.checkpoint_layout(None) == {"second": {"schedule": "1F1B", "stages": [0, 2]}}  # (first's empty: none)
    assert both.train_loader(None) is None and both.summary(0) == {}  # a hook no part overrides: nothing
    assert type(parts()) is InstalledParts and parts().parts == installed_parts()


@pytest.mark.quick
def test_a_hook_one_part_may_answer_is_refused_when_two_do_naming_both() -> None:
    class Runner(Part):
        name = "stages"

        def model_runner(self, model, run):
            return f"{self.name}'s runner"

    class OtherRunner(Runner):
        name = "other"

    class Silent(Runner):
        name = "silent"

        def model_runner(self, model, run):
            return None

    assert HOOKS["model_runner"] is HOOKS["train_loader"] is HOOKS["lr_multiplier"] is Combine.ONE
    assert InstalledParts([Runner(), Silent()]).model_runner(None, None) == "stages's runner"
    with pytest.raises(ArgumentError, match="parts/stages and parts/other both answer Part.model_runner, which one "
                                            "part may answer at most; turn one of them off"):
        InstalledParts([Runner(), Silent(), OtherRunner()]).model_runner(None, None)


@pytest.mark.quick
def test_a_part_cannot_hide_what_it_declares() -> None:
    """`self.flags = ...` in a part's __init__ hid its flag dataclass (the core then read no flags): refused, as is
    a `flags` that is not a dataclass, when the part is defined."""

    @dataclass
    class OwnFlags:
        own_rate: float = 0.5

    class Hiding(Part):
        name = "hiding"
        flags = OwnFlags

        def __init__(self) -> None:
            self.flags = OwnFlags()

    for attribute in ("flags", "name", "after_prepare"):
        with pytest.raises(TypeError, match=f"Hiding.{attribute} = ... would hide the part's declared {attribute}"):
            setattr(Hiding.__new__(Hiding), attribute, None)
    with pytest.raises(TypeError, match="Hiding.flags = ... would hide"):
        Hiding()
    with pytest.raises(TypeError, match=r"NotAClass.flags is .*OwnFlags\(own_rate=0.5\): a part's flags are a dataclass"):
        type("NotAClass", (Part,), {"name": "not_a_class", "flags": OwnFlags()})
    with pytest.raises(TypeError, match="flags is <class 'int'>"):
        type("NotADataclass", (Part,), {"name": "not_a_dataclass", "flags": int})
