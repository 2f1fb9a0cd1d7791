"""Launch a short job many times per config and count the launches that did not end cleanly.

    python scripts/stress_launch.py                          # 50 launches of every config in accelerate_configs/
    python scripts/stress_launch.py --launches 10 --configs deepspeed_zero3 fsdp --keep_failures /tmp/failures

Rare faults at start-up or exit (a rank that aborts after the run finished, a hang) show up
only over many launches; the test suite launches each config a few times. Each launch is
`accelerate launch --config_file accelerate_configs/<config>.yaml train.py` on the tiny
model for `--max_steps` steps, with the config's own process count (2; fsdp_tp 4; single 1).
A launch is clean when it exits 0, wrote `final/` and summary.json, and no rank printed
`terminate called` (C++ std::terminate, which kills a rank with SIGABRT). The table counts
exits and aborts per config; the script exits 1 if any launch was not clean. Not part of the
test suite: 50 launches of 8 configs took 1 h 46 min on 2 CPU cores (10 to 26 s a launch).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark import REPO, environment, free_port

ABORT_MARKERS = ("terminate called", "Signal 6 (SIGABRT)", "exitcode  : -6")


def launch(config: str, args: argparse.Namespace, output_dir: Path) -> tuple[int | str, bool, str]:
    """One launch: its exit code (or "timeout"), whether a rank aborted, and everything it printed."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}.yaml",
               "--main_process_port", str(free_port()), "train.py", "--model_config", "llama-tiny",
               "--max_steps", str(args.max_steps), "--block_size", str(args.block_size), "--output_dir", str(output_dir)]
    try:
        done = subprocess.run(command, cwd=REPO, env=environment(output_dir), capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired as stuck:
        return "timeout", False, f"{stuck.stdout or ''}\n{stuck.stderr or ''}"
    printed = f"{done.stdout}\n{done.stderr}"
    code = done.returncode
    if code == 0 and not ((output_dir / "final").is_dir() and (output_dir / "summary.json").is_file()):
        code = "0 without final/"
    return code, any(marker in printed for marker in ABORT_MARKERS), printed


def one_launch(config: str, attempt: int, args: argparse.Namespace) -> tuple[int | str, bool, float]:
    """Launch once in a scratch directory; keep its output if it was not clean. Returns code, aborted, seconds."""
    with tempfile.TemporaryDirectory(prefix=f"stress-{config}-") as scratch:
        started = time.perf_counter()
        code, aborted, printed = launch(config, args, Path(scratch) / "run")
        seconds = time.perf_counter() - started
        if (code != 0 or aborted) and args.keep_failures:
            kept = args.keep_failures / f"{config}-{attempt}"
            kept.mkdir(parents=True, exist_ok=True)
            (kept / "output.log").write_text(printed)
            shutil.copytree(scratch, kept / "files", dirs_exist_ok=True)
    print(f"{config} {attempt}/{args.launches}: exit {code}{' ABORT' if aborted else ''} ({seconds:.0f} s)",
          file=sys.stderr, flush=True)
    return code, aborted, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=50, help="launches per config")
    parser.add_argument("--configs", nargs="+", default=sorted(path.stem for path in (REPO / "accelerate_configs").glob("*.yaml")))
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--timeout", type=int, default=600, help="seconds before a launch counts as hung")
    parser.add_argument("--parallel", type=int, default=1,
                        help="launches running at once; a loaded machine made the exit race of issue 22 rarer, not likelier")
    parser.add_argument("--keep_failures", type=Path, help="copy the output of every launch that was not clean here")
    args = parser.parse_args()

    rows = []
    for config in args.configs:
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            results = list(pool.map(lambda attempt: one_launch(config, attempt, args), range(1, args.launches + 1)))
        exits = collections.Counter(code for code, _, _ in results)
        aborts = sum(aborted for _, aborted, _ in results)
        rows.append((config, args.launches, exits, aborts, sum(seconds for _, _, seconds in results) / len(results)))

    print("\n| config | launches | exit 0 | other exits | aborts | s/launch |\n|---|---:|---:|---|---:|---:|")
    for config, launches, exits, aborts, mean_s in rows:
        other = ", ".join(f"{code}: {count}" for code, count in exits.items() if code != 0) or "none"
        print(f"| {config} | {launches} | {exits[0]} | {other} | {aborts} | {mean_s:.1f} |")
    clean = all(exits[0] == launches and aborts == 0 for _, launches, exits, aborts, _ in rows)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
