"""Lines of Python in the core and in each part, as docs/layout.md shows them (tests/test_module_layout.py
checks the page against this script).

    python scripts/count_lines.py            # the table, in markdown
    python scripts/count_lines.py --write    # and into docs/layout.md, in place of the table there

The core is train.py, training/, data/ and models/: what the promise needs, and what a fork without parts
keeps (issue 36's goal for it: at most 3,000 lines). A part is a folder of parts/ (training/parts.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORE = ("train.py", "training", "data", "models")


def python_lines(path: Path) -> int:
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    return sum(len(file.read_text().splitlines()) for file in files)


def counts(repo: Path = REPO) -> dict[str, int]:
    """'core', then 'parts/<name>' for each part, in name order: lines of Python."""
    parts = sorted(path for path in (repo / "parts").iterdir() if path.is_dir() and not path.name.startswith("_"))
    return {"core": sum(python_lines(repo / name) for name in CORE),
            **{f"parts/{part.name}": python_lines(part) for part in parts}}


def table(repo: Path = REPO) -> str:
    rows = [f"| `{name}` | {lines:,} |" for name, lines in counts(repo).items()]
    return "\n".join(["| code | lines of Python |", "|---|---:|", *rows])


def write_layout_page(repo: Path = REPO) -> None:
    """docs/layout.md with its table of lines replaced by today's."""
    page = repo / "docs" / "layout.md"
    old = re.compile(r"\| code \| lines of Python \|\n(\|.*\|\n)+")
    page.write_text(old.sub(table(repo) + "\n", page.read_text(), count=1))


if __name__ == "__main__":
    print(table())
    if "--write" in sys.argv[1:]:
        write_layout_page()
