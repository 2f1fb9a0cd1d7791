"""Where a local data file stops parsing, as its 1-based line and why: `datasets` gives pyarrow's 0-based row, often
with the wrong cause, deep in a traceback. Python's own parsers look only once loading has failed."""

from __future__ import annotations

import csv
import glob
import json
from pathlib import Path


def first_bad_line(path: str, builder: str) -> tuple[int, str] | None:
    """(line, reason) of the first line `builder` ("json" or "csv") cannot parse; None if none, or for other formats."""
    parse = {"json": _json_error, "csv": _csv_error}.get(builder)
    return parse(Path(path).read_text(encoding="utf-8", errors="replace")) if parse else None


def _json_error(text: str) -> tuple[int, str] | None:
    try:  # one JSON document: an array of records, or an object of columns
        json.loads(text)
        return None
    except json.JSONDecodeError as whole:
        if text.lstrip().startswith("["):
            return whole.lineno, f"is not valid JSON ({whole.msg})"
    for number, line in enumerate(text.splitlines(), start=1):  # JSON Lines: one record per line
        try:
            if line.strip():
                json.loads(line)
        except json.JSONDecodeError as error:
            return number, f"is not a valid JSON record ({error.msg})"
    return None


def _csv_error(text: str) -> tuple[int, str] | None:
    reader = csv.reader(text.splitlines(keepends=True), strict=True)
    header, start = None, 1
    try:
        for row in reader:
            if header is None:
                header = row
            elif row and len(row) != len(header):
                return start, f"has {len(row)} fields where the header has {len(header)}"
            start = reader.line_num + 1
    except csv.Error as error:
        return start, f"is not valid CSV ({error}: a quoted field that never closes?)"
    return None


def describe_unreadable(files: dict[str, str], builder: str, cause: BaseException) -> str:
    """One line for local data files that failed to load: the file and line at fault, where one is found."""
    for pattern in files.values():
        for path in sorted(glob.glob(pattern)) or [pattern]:
            if found := first_bad_line(path, builder):
                return f"cannot read {path}: line {found[0]} {found[1]}; fix or remove that line"
    reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return f"cannot read {' and '.join(files.values())} as {builder}: {reason}"
