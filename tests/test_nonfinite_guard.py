"""The non-finite guard (training/step.py) decides from the values fp16 and fp32 runs produce."""

from __future__ import annotations

import math

import pytest
import torch

from training.errors import NonFiniteLossError
from training.step import NonFiniteGuard

pytestmark = pytest.mark.quick  # every test here: the quick tier (pytest -m quick)

INF, NAN = math.inf, math.nan


def one_process(guard: NonFiniteGuard) -> dict[str, torch.Tensor]:
    """`gather_scalars` of the guard's state, on one process."""
    return {name: value.reshape(1).double() for name, value in guard.local().items()}


def guard_after(steps: list[tuple[float, float]], loss_scaling: bool) -> NonFiniteGuard:
    guard = NonFiniteGuard(torch.device("cpu"), loss_scaling=loss_scaling)
    for step, (loss, grad_norm) in enumerate(steps, start=1):
        guard.update(step, torch.tensor(loss), torch.tensor(grad_norm))
    return guard


def first_bad_step(guard: NonFiniteGuard) -> int | None:
    try:
        guard.check(one_process(guard))
    except NonFiniteLossError as error:
        return int(str(error).split(" at step ")[1].split(";")[0])
    return None


FP16_OVERFLOWS = [(2.5, 1.0), (2.4, INF), (2.4, INF), (2.3, 0.9), (2.2, INF), (2.2, 0.8)]  # a scaler finding its scale


def test_fp16_overflow_steps_are_counted_not_fatal() -> None:
    guard = guard_after(FP16_OVERFLOWS, loss_scaling=True)
    assert first_bad_step(guard) is None
    assert guard.logged(one_process(guard)) == {"skipped_steps": 3}


def test_without_loss_scaling_an_infinite_gradient_norm_stops_at_its_step() -> None:
    guard = guard_after(FP16_OVERFLOWS, loss_scaling=False)
    assert first_bad_step(guard) == 2
    assert guard.logged(one_process(guard)) == {}


@pytest.mark.parametrize("loss_scaling", [True, False])
def test_a_non_finite_loss_always_stops_at_its_step(loss_scaling: bool) -> None:
    assert first_bad_step(guard_after([(2.5, 1.0), (2.4, 1.0), (NAN, NAN), (2.4, 1.0)], loss_scaling)) == 3
    assert first_bad_step(guard_after([(2.5, 1.0), (INF, 1.0)], loss_scaling)) == 2


def test_fp16_stops_after_too_many_overflows_in_a_row() -> None:
    streak = NonFiniteGuard.MAX_SKIPPED_IN_A_ROW
    broken = [(2.5, 1.0), *[(2.5, INF)] * (streak - 1), (2.5, 1.0), *[(2.5, INF)] * streak]
    guard = guard_after(broken, loss_scaling=True)
    assert first_bad_step(guard) == 1 + (streak - 1) + 1 + streak  # the streak's last step, not the earlier run
    assert guard.logged(one_process(guard)) == {"skipped_steps": 2 * streak - 1}
    with pytest.raises(NonFiniteLossError, match="fp16 overflowed 20 steps in a row"):
        guard.check(one_process(guard))
