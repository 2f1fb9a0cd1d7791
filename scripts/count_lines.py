"""Lines of Python in the core and in each part, as docs/layout.md shows them (scripts/part_tables.py writes them
there).

    python scripts/count_lines.py            # the table, in markdown

The core is train.py, training/, data/ and models/: what the promise needs, and what a fork without parts
keeps (issue 36's goal for it: at most 3,000 lines). A part is a folder of parts/ (training/parts.py).
"""

from __future__ import annotations

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


if __name__ == "__main__":
    for name, lines in counts().items():
        print(f"{name:28} {lines:>6,}")
