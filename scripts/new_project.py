"""Start your own project from this template: the core plus the parts you name, nothing else.

    python scripts/new_project.py --list                          # one part per line: its name, then what it does
    python scripts/new_project.py ../my-project                   # the core alone
    python scripts/new_project.py ../my-project --keep sft,lora   # the core and two parts

A part owns `parts/<name>/`, `tests/test_<name>.py`, `docs/<name>.md` and the files its `Part.files` names
(training/parts.py), and is kept only with the parts it builds on (`Part.needs`); a part left out takes them along
(a file several parts name, only when all of them are left out), and so do:
- the requirements only it needs (`Part.requirements`), from requirements.txt;
- in every page kept, the table rows, list items, sentences and command lines that name it (its files, its
  flags, its page), and the Makefile targets that run its files;
- the tests of other files that need it (marked `@pytest.mark.parts(...)`: tests/conftest.py deselects them
  where a part is missing, so the fork's own suite runs what it can hold).
The pages' rows that come from the parts are written for the fork (scripts/part_tables.py), and the files that
serve only this template (this script and its test) stay behind. DEST must not exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.part_tables import write_pages  # noqa: E402
from training.parts import Part, installed_parts  # noqa: E402 - imports nothing heavy

TEMPLATE_ONLY = ("scripts/new_project.py", "tests/test_new_project.py")  # what makes projects of this template
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


def mentions_of(parts: list[Part], paths: list[str]) -> re.Pattern:
    """What names a part left out: its files (`paths`, as paths or, for a package, as a module), its flags, its page."""
    names = [re.escape(path) if path.count("/") == 1 and path.endswith("/") else re.escape(path.rstrip("/")) + r"(?!\w)"
             for path in paths]  # a top-level folder with its slash (`recipes/`, not the word), else the path
    names += [re.escape(path.rstrip("/").replace("/", ".")) + r"\.\w" for path in paths if path.endswith("/")]
    names += [rf"--{field.name}\b" for part in parts if part.flags for field in dataclasses.fields(part.flags)]
    names += [rf"\]\(({re.escape(part.name)}|docs/{re.escape(part.name)})\.md" for part in parts]
    return re.compile("|".join(names)) if names else re.compile(r"(?!)")


# after . ! or ?, and any closing mark (`**`, a parenthesis, a quote): not in e.g., i.e. or vs.
SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][)`'\"])|(?<=[.!?]\*\*))(?<!e\.g\.)(?<!i\.e\.)(?<!vs\.)(\s+)(?=\S)")


def without_mentions(text: str, page: Path, gone: set[Path], mentions: re.Pattern) -> str:
    """A kept page without what names a part left out: table rows and lines of code blocks whole, and in prose (list
    items too) the sentences; a list item or paragraph left empty goes, and so does a heading left with nothing."""
    def named(part: str) -> bool:
        return bool(mentions.search(part)) or any((page.parent / link.group(3)).resolve() in gone
                                                  for link in LINK.finditer(part))

    def prose(block: str) -> str:
        pieces = SENTENCE_END.split(block)  # sentence, separator, sentence, ...
        kept = [(sentence, separator) for sentence, separator in zip(pieces[::2], [*pieces[1::2], ""])
                if not named(sentence)]
        return "".join(sentence + separator for sentence, separator in kept).rstrip()

    out, block, fenced = [], [], False

    def flush() -> None:
        if block:
            marker = re.match(r"(\s*(?:[-*]|\d+\.)\s+)", block[0])
            text = "\n".join(block)
            body = prose(text[marker.end():] if marker else text)
            if body and not (marker and body.startswith(("(", ":"))):
                out.append((marker.group(1) if marker else "") + body)
            block.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            flush()
            fenced = not fenced
            out.append(line)
        elif fenced or line.startswith("|"):
            if not named(line):
                out.append(line)
        elif not line.strip() or line.startswith(("#", "<!--")):
            flush()
            out.append(line)
        elif re.match(r"\s*(?:[-*]|\d+\.)\s+", line) and not line.startswith("  "):
            flush()
            block.append(line)
        else:
            block.append(line)
    flush()
    return unlinked(without_empty_sections("\n".join(out)) + "\n", page, gone)


def without_empty_sections(text: str) -> str:
    """Headings (below the title) whose section holds nothing but blank lines dropped, with the page's links to them
    (its contents list); blank runs made one."""
    lines, kept, dropped = text.splitlines(), [], set()
    for index, line in enumerate(lines):
        if line.startswith("##"):
            level = len(line) - len(line.lstrip("#"))
            rest = next((other for other in lines[index + 1:] if other.strip()), "")
            if not rest or (rest.startswith("#") and len(rest) - len(rest.lstrip("#")) <= level):
                dropped.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))  # GitHub's id
                continue
        kept.append(line)
    kept = [line for line in kept if not (line.lstrip().startswith("- [") and
                                          {match.group(1) for match in re.finditer(r"\]\(#([^)]+)\)", line)} & dropped)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept))


def makefile_without(text: str, mentions: re.Pattern) -> str:
    """The Makefile without the targets whose commands run a file gone (and without them in .PHONY)."""
    blocks, targets = re.split(r"\n(?=\S)", text), []
    kept = []
    for block in blocks:
        if re.match(r"[\w-]+:", block) and mentions.search(block):
            targets.append(block.split(":", 1)[0])
        else:
            kept.append(block)
    return re.sub(r"^(\.PHONY:.*)$", lambda m: " ".join(w for w in m.group(1).split() if w not in targets),
                  "\n".join(kept), flags=re.M)


def requirements_without(text: str, packages: set[str]) -> str:
    """requirements.txt without the pins of `packages`."""
    return "".join(line + "\n" for line in text.splitlines() if re.split(r"[=<>~ ]", line, maxsplit=1)[0] not in packages)


def new_project(destination: Path, keep: list[str], repo: Path = REPO) -> list[str]:
    """Write the fork to `destination`; returns the parts it holds."""
    parts = {part.name: part for part in installed_parts()}
    if unknown := sorted(set(keep) - parts.keys()):
        raise SystemExit(f"error: no part named {', '.join(unknown)}; `python scripts/new_project.py --list` names them")
    if missing := sorted({need for name in keep for need in parts[name].needs} - set(keep)):
        raise SystemExit(f"error: the parts kept build on {', '.join(missing)} (`Part.needs`); keep it too (--keep "
                         f"{','.join([*keep, *missing])})")
    if destination.exists():
        raise SystemExit(f"error: {destination} exists; give a new directory")
    left_out = [part for name, part in parts.items() if name not in keep]
    kept_files = {path for name in keep for path in owned_files(parts[name])}  # a file two parts own stays with either
    owned = [path for part in left_out for path in owned_files(part) if path not in kept_files]
    files = [path for path in template_files(repo) if path not in TEMPLATE_ONLY and not any(
        path == own or path.startswith(own) for own in owned if own.endswith("/") or path == own)]
    destination.mkdir(parents=True)
    for path in files:
        (destination / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / path, destination / path)
    gone = {(destination / path).resolve() for path in owned if not path.endswith("/")}
    mentions = mentions_of(left_out, [*owned, *TEMPLATE_ONLY])
    for page in destination.rglob("*.md"):
        page.write_text(without_mentions(page.read_text(), page, gone, mentions))
    makefile = destination / "Makefile"
    makefile.write_text(makefile_without(makefile.read_text(), mentions))
    needed = {package for name in keep for package in parts[name].requirements}
    dropped = {package for part in left_out for package in part.requirements} - needed
    requirements = destination / "requirements.txt"
    requirements.write_text(requirements_without(requirements.read_text(), dropped))
    write_pages(destination, tuple(part for part in installed_parts() if part.name in keep))
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
