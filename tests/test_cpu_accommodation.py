"""The CPU accommodation in training/strategy/cpu.py, and the silent fallbacks it guards against.

These run real 2-process launches. If a new accelerate changes how it treats FSDP on a
machine without a GPU, the `plain`/`gloo_kwarg`/`cpu_flag` expectations fail first: read
training/strategy/cpu.py's docstring and re-measure before changing the accommodation.
"""

from __future__ import annotations

import json

import pytest

from tests.harness import REPO, launch

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

PROBE = REPO / "tests" / "probes" / "strategy_probe.py"

# scenario -> (what accelerate sets up under fsdp.yaml on CPU, what our guard says)
FSDP_ON_CPU = {
    # accelerate 1.15 refuses FSDP on CPU silently: each process trains alone.
    "plain": ({"distributed_type": "NO", "num_processes": 1}, "refused: 2 processes were launched but accelerate sees 1"),
    # a gloo group of 2, yet no strategy: gradients would never be synchronised.
    "gloo_kwarg": ({"distributed_type": "NO", "num_processes": 2}, "refused: 2 processes but no distributed strategy"),
    # plain DDP instead of the FSDP the config asked for.
    "cpu_flag": ({"distributed_type": "MULTI_CPU", "num_processes": 2}, "refused: the config asked for fsdp"),
    # the template: real FSDP2 over gloo on device cpu.
    "template": ({"distributed_type": "FSDP", "num_processes": 2, "device": "cpu", "backend": "gloo",
                  "wrapper": "FSDPSequential", "timeout_s": 123}, "ok"),
}


def probe(config: str, scenario: str, tmp_path) -> list[dict]:
    result = launch(config, PROBE, scenario, str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("scenario", sorted(FSDP_ON_CPU))
def test_fsdp_on_cpu(scenario: str, tmp_path) -> None:
    expected_state, expected_verdict = FSDP_ON_CPU[scenario]
    for record in probe("fsdp", scenario, tmp_path):
        assert record.items() >= expected_state.items(), record
        assert record["verdict"].startswith(expected_verdict), record


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("ddp", {"distributed_type": "MULTI_CPU", "num_processes": 2, "wrapper": "DistributedDataParallel",
                 "timeout_s": 123}),
        ("deepspeed_zero2", {"distributed_type": "DEEPSPEED", "num_processes": 2, "backend": "gloo",
                             "wrapper": "DeepSpeedEngine", "timeout_s": 123}),
    ],
)
def test_template_accelerator_on_cpu(config: str, expected: dict, tmp_path) -> None:
    """The configured strategy, and --ddp_timeout reaching the process group (DeepSpeed included)."""
    for record in probe(config, "template", tmp_path):
        assert record.items() >= expected.items(), record
