"""Compare two runs' `metrics.jsonl` step by step and report the largest difference.

    python scripts/compare_metrics.py outputs/ddp outputs/fsdp                 # loss, lr, eval_loss
    python scripts/compare_metrics.py runA runB --keys loss --tolerance 1e-5   # exit 1 above it

Use it to check that a config change (strategy, process count, accumulation) left the
training itself unchanged. Arguments are run directories or metrics.jsonl files.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the template's modules
from training.metrics import read_metrics  # noqa: E402

DEFAULT_KEYS = ("loss", "lr", "eval_loss")


@dataclass
class Difference:
    key: str
    step: int
    first: float
    second: float

    @property
    def absolute(self) -> float:
        return abs(self.first - self.second)


def read_series(path: str | Path) -> dict[str, dict[int, float]]:
    """{key: {step: value}} from a run directory or a metrics.jsonl file."""
    series: dict[str, dict[int, float]] = {}
    for record in read_metrics(path):
        for key, value in record.items():
            if key != "step":
                series.setdefault(key, {})[record["step"]] = value
    return series


def compare(first: str | Path, second: str | Path, keys: tuple[str, ...] = DEFAULT_KEYS) -> list[Difference]:
    """Per-step differences for `keys` on the steps both runs logged.

    A key or step logged by only one run is an error: the runs are not comparable.
    """
    a, b = read_series(first), read_series(second)
    differences = []
    for key in keys:
        if key not in a or key not in b:
            raise ValueError(f"{key!r} is missing from {'the first' if key not in a else 'the second'} run")
        if a[key].keys() != b[key].keys():
            raise ValueError(f"{key!r} was logged at different steps: {sorted(a[key])} vs {sorted(b[key])}")
        differences += [Difference(key, step, a[key][step], b[key][step]) for step in sorted(a[key])]
    return differences


def worst_difference(differences: list[Difference]) -> Difference:
    """The largest difference, a NaN one first: `max` alone never picks a NaN after the first item
    (max([0.0, 1e-7, nan]) is 1e-7), and a run whose loss became NaN would pass any tolerance."""
    if not differences:
        raise ValueError("no step logged by both runs: nothing was compared")
    return max(differences, key=lambda d: math.inf if math.isnan(d.absolute) else d.absolute)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS))
    parser.add_argument("--tolerance", type=float, default=None, help="exit 1 if a difference exceeds it")
    args = parser.parse_args()
    try:
        differences = compare(args.first, args.second, tuple(args.keys))
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")
    for key in args.keys:
        rows = [d for d in differences if d.key == key]
        worst = worst_difference(rows)
        print(f"{key:>10}: {len(rows)} steps, largest difference {worst.absolute:.3g} at step {worst.step} "
              f"({worst.first:.8g} vs {worst.second:.8g})")
    if args.tolerance is not None and not all(d.absolute <= args.tolerance for d in differences):  # NaN fails too
        sys.exit(1)


if __name__ == "__main__":
    main()
