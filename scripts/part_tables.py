"""The pages' rows that come from the parts, written from the parts themselves so that a project holds the rows of
the parts it holds: docs/layout.md's table of code (the core's and each part's lines of Python, and what each part
does), the README's list of the parts' pages, and docs/train-py.md's flags of each part. Each sits between
`<!-- parts: NAME -->` and `<!-- /parts -->`; tests/test_module_layout.py checks the pages against this script.

    python scripts/part_tables.py            # the lines of Python: the core (what a fork without parts keeps), each part
    python scripts/part_tables.py --write    # after adding, removing or changing a part
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.parts import Part, installed_parts  # noqa: E402 - imports nothing heavy

BLOCK = re.compile(r"(<!-- parts: (\w+) -->\n).*?(<!-- /parts -->)", re.DOTALL)
PAGES = ("README.md", "docs/layout.md", "docs/train-py.md")
CORE = ("train.py", "training", "data", "models")


def python_lines(path: Path) -> int:
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    return sum(len(file.read_text().splitlines()) for file in files)


def counts(repo: Path = REPO) -> dict[str, int]:
    """'core', then 'parts/<name>' for each part, in name order: lines of Python."""
    parts = sorted(path for path in (repo / "parts").iterdir() if path.is_dir() and not path.name.startswith("_"))
    return {"core": sum(python_lines(repo / name) for name in CORE),
            **{f"parts/{part.name}": python_lines(part) for part in parts}}


def flag_names(part: Part) -> list[str]:
    return [f"`--{field.name}`" for field in dataclasses.fields(part.flags)] if part.flags else []


def code_table(repo: Path, parts: Iterable[Part]) -> str:
    """The core's and each part's lines of Python, and what each part does."""
    described = {f"parts/{part.name}": part.description for part in parts}
    rows = [f"| `{name}` | {lines:,} | {described.get(name, 'the loop, strategies, checkpoints, the causal LM')} |"
            for name, lines in counts(repo).items()]
    return "\n".join(["| code | lines of Python | what it is |", "|---|---:|---|", *rows])


def page_list(repo: Path, parts: Iterable[Part]) -> str:
    """The README's item that links every part's page."""
    pages = ", ".join(f"[{part.name}](docs/{part.name}.md)" for part in parts)
    return f"- The parts' pages: {pages}." if pages else "- No parts: this project is the core alone."


def flag_table(repo: Path, parts: Iterable[Part]) -> str:
    """docs/train-py.md's flags of each part, linked to its page."""
    rows = [f"| [{part.name}]({part.name}.md) | {', '.join(names)} |" for part in parts if (names := flag_names(part))]
    return "\n".join(["| part | its flags |", "|---|---|", *rows]) if rows else "No part adds flags here."


TABLES: dict[str, Callable[[Path, Iterable[Part]], str]] = {"code": code_table, "pages": page_list,
                                                            "flags": flag_table}


def written(text: str, repo: Path, parts: tuple[Part, ...]) -> str:
    """`text` (a page) with each block of parts' rows written for `parts`."""
    return BLOCK.sub(lambda match: f"{match.group(1)}{TABLES[match.group(2)](repo, parts)}\n{match.group(3)}", text)


def write_pages(repo: Path = REPO, parts: tuple[Part, ...] | None = None) -> None:
    parts = installed_parts() if parts is None else parts
    for name in PAGES:
        page = repo / name
        page.write_text(written(page.read_text(), repo, parts))


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write_pages()
    else:
        for name, lines in counts().items():
            print(f"{name:28} {lines:>6,}")
