"""Same seed, same global batch: every strategy computes the same training (fp32, CPU).

Tolerances, and why:
- DDP, ZeRO-1/2/3, FSDP2 and FSDP2 x TP differ from one process only in how gradients are
  summed (micro-batches of 3 accumulated on 2 ranks and all-reduced, instead of 4 micro-batches
  accumulated on one), i.e. float rounding
  in the last bits, compounded over a few Adam steps: losses agree to 1e-5 and weights to
  1e-5 here. Between themselves, DDP and ZeRO agree to the same bound.
- Clipping is checked here where it triggers (max_grad_norm 0.5, below the gradient norms of
  these steps) on every config. Where it never does, on DeepSpeed's optimizer code paths (whose
  clipping is configured apart from train.py, in the JSON): tests/test_distillation.py, whose
  runs clip at 0.5 above their gradient norms and match one process to the same bounds (DDP and
  FSDP2 run the same torch clipping call either way).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.compare_metrics import compare, worst_difference
from tests.harness import CONFIGS, REPO, STRATEGY_CLIPPING, assert_same_final_weights, read_metrics

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

MULTI_PROCESS_CONFIGS = sorted(path.stem for path in CONFIGS.glob("*.yaml") if path.stem != "single")
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-5


@pytest.mark.parametrize("config", MULTI_PROCESS_CONFIGS)
def test_every_config_file_matches_one_process(config: str, strategy_run) -> None:
    """Swapping the config file is all it takes: the strategy runs (tests/conftest.py `parity_args`,
    no default left) give one process's losses, lr, eval and final weights."""
    reference, run = strategy_run("single"), strategy_run(config)
    differences = compare(reference, run, keys=("loss", "lr", "eval_loss"))
    assert len(differences) == 12 * 2 + 3  # loss and lr at every step, eval at the start, step 6 and the end
    worst = worst_difference(differences)
    assert worst.absolute <= LOSS_TOLERANCE, worst

    grad_norms = [m["grad_norm"] for m in read_metrics(run) if "grad_norm" in m]
    assert max(grad_norms) > STRATEGY_CLIPPING, grad_norms  # clipping triggers

    assert_same_final_weights(reference, run, atol=WEIGHT_TOLERANCE)


def write_metrics(run: Path, records: list[dict]) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run


@pytest.mark.quick
@pytest.mark.parametrize("poisoned", [{"eval_loss": math.nan}, {"loss": math.nan}, {"loss": math.inf}])
def test_a_nan_in_one_run_fails_the_comparison_wherever_it_is(tmp_path, poisoned) -> None:
    """The comparison every parity-style test uses: one non-finite figure, even among smaller differences, is
    the worst difference, which no tolerance admits; a figure one run did not log is an error."""
    steps = [{"step": 1, "loss": 2.0, "lr": 1e-3}, {"step": 2, "loss": 1.5, "lr": 1e-3, "eval_loss": 1.4},
             {"step": 3, "loss": 1.2, "lr": 1e-3}]
    reference = write_metrics(tmp_path / "reference", steps[:2] + [steps[2] | {"loss": 1.2000001}])
    bad = write_metrics(tmp_path / "poisoned", [steps[0], steps[1] | poisoned, steps[2]])
    worst = worst_difference(compare(reference, bad))
    without_eval = {key: value for key, value in steps[1].items() if key != "eval_loss"}
    assert worst.step == 2 and not worst.absolute <= LOSS_TOLERANCE
    with pytest.raises(ValueError, match="'eval_loss' is missing from the second run"):
        compare(reference, write_metrics(tmp_path / "no_eval", [steps[0], without_eval, steps[2]]))
    with pytest.raises(ValueError, match=r"'loss' was logged at different steps: \[1, 2, 3\] vs \[1, 2\]"):
        compare(reference, write_metrics(tmp_path / "stopped", steps[:2]))
    command = [sys.executable, "scripts/compare_metrics.py", str(reference), str(bad), "--tolerance", "1"]
    assert subprocess.run(command, cwd=REPO, capture_output=True).returncode == 1
