"""Start your own project from this template: the core plus the parts you name, nothing else.

    python scripts/new_project.py --list                          # one part per line: its name, then what it does
    python scripts/new_project.py ../my-project                   # the core alone
    python scripts/new_project.py ../my-project --keep sft,lora   # the core and two parts

A part owns `parts/<name>/`, `tests/test_<name>.py`, `docs/<name>.md` and the files its `Part.files` names
(training/parts.py); a part left out takes them along, and so do:
- the requirements only it needs (`Part.requirements`), from requirements.txt;
- the README's rows and lines that link to its page, and in every page kept, links to a page gone (their text
  stays);
- the tests of other files that need it (marked `@pytest.mark.parts(...)`: tests/conftest.py deselects them
  where a part is missing, so the fork's own suite runs what it can hold).
Then docs/layout.md's table of lines is written for the fork (scripts/count_lines.py). DEST must not exist.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.count_lines import write_layout_page  # noqa: E402
from training.parts import Part, installed_parts  # noqa: E402 - imports nothing heavy

LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)#\s]+)(#[^)\s]*)?\)")  # a link, or an image (!)


def owned_files(part: Part) -> list[str]:
    """The repository paths a part owns (directories end with /)."""
    return [f"parts/{part.name}/", f"tests/test_{part.name}.py", f"docs/{part.name}.md", *part.files]


def template_files(repo: Path) -> list[str]:
    """The template's files: what git tracks, or, outside a checkout, every file but caches and outputs."""
    listed = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:
        return [line for line in listed.stdout.splitlines() if (repo / line).is_file()]
    skipped = {".git", ".venv", "outputs", "__pycache__", ".pytest_cache"}
    return [str(path.relative_to(repo)) for path in repo.rglob("*")
            if path.is_file() and not skipped & set(path.relative_to(repo).parts)]


def unlinked(text: str, page: Path, gone: set[Path]) -> str:
    """`text` (a markdown page at `page`) with every link to a file in `gone` replaced by the link's text, and
    every image of one dropped."""
    def replace(match: re.Match) -> str:
        if (page.parent / match.group(3)).resolve() not in gone:
            return match.group(0)
        return "" if match.group(1) else match.group(2)

    return LINK.sub(replace, text)


def readme_without(text: str, readme: Path, gone: set[Path]) -> str:
    """The README without the table rows (a recipe of a part gone) and pictures that link to a file gone, and
    without the list items (with their indented lines) whose links all do."""
    def gone_links(lines: list[str]) -> list[bool]:
        return [(readme.parent / match.group(3)).resolve() in gone for line in lines for match in LINK.finditer(line)]

    blocks: list[list[str]] = []  # a list item and its indented lines, or one other line
    for line in text.splitlines():
        if line.startswith("  ") and blocks and blocks[-1][0].startswith("- "):
            blocks[-1].append(line)
        else:
            blocks.append([line])
    kept = []
    for block in blocks:
        found = gone_links(block)
        if not ((block[0].startswith(("|", "![")) and any(found)) or (block[0].startswith("- ") and found and all(found))):
            kept += block
    return unlinked("\n".join(kept) + "\n", readme, gone)


def requirements_without(text: str, packages: set[str]) -> str:
    """requirements.txt without the pins of `packages`."""
    return "".join(line + "\n" for line in text.splitlines() if re.split(r"[=<>~ ]", line, maxsplit=1)[0] not in packages)


def new_project(destination: Path, keep: list[str], repo: Path = REPO) -> list[str]:
    """Write the fork to `destination`; returns the parts it holds."""
    parts = {part.name: part for part in installed_parts()}
    if unknown := sorted(set(keep) - parts.keys()):
        raise SystemExit(f"error: no part named {', '.join(unknown)}; `python scripts/new_project.py --list` names them")
    if destination.exists():
        raise SystemExit(f"error: {destination} exists; give a new directory")
    left_out = [part for name, part in parts.items() if name not in keep]
    owned = [path for part in left_out for path in owned_files(part)]
    files = [path for path in template_files(repo) if not any(path == own or path.startswith(own) for own in owned
                                                               if own.endswith("/") or path == own)]
    destination.mkdir(parents=True)
    for path in files:
        (destination / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / path, destination / path)
    gone = {(destination / path).resolve() for path in owned if not path.endswith("/")}
    for page in destination.rglob("*.md"):
        text = page.read_text()
        page.write_text(readme_without(text, page, gone) if page.name == "README.md" and page.parent == destination
                        else unlinked(text, page, gone))
    needed = {package for name in keep for package in parts[name].requirements}
    dropped = {package for part in left_out for package in part.requirements} - needed
    requirements = destination / "requirements.txt"
    requirements.write_text(requirements_without(requirements.read_text(), dropped))
    write_layout_page(destination)
    return sorted(keep)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("destination", nargs="?", type=Path, help="The new project's directory (must not exist).")
    parser.add_argument("--keep", default="", help="Parts to keep, comma-separated (default: none, the core alone).")
    parser.add_argument("--list", action="store_true", help="Print one part per line: its name, then what it does.")
    args = parser.parse_args(argv)
    if args.list:
        for part in installed_parts():
            print(f"{part.name}  {part.description}")
        return
    if args.destination is None:
        parser.error("give a destination directory, or --list")
    kept = new_project(args.destination, [name for name in args.keep.split(",") if name])
    print(f"{args.destination}: the core{' and ' + ', '.join(kept) if kept else ''}. Next: cd {args.destination} && "
          "python -m pytest -m quick")


if __name__ == "__main__":
    main()
