"""fp16 dynamic loss scaling: unscale, overflow detection, back-off and growth, state round trip,
and the step guard's verdicts on an overflow (one process; the agreement over ranks is
tests/dist/test_fp16.py)."""

import math

import pytest
import torch

from parallel.loss_scale import DynamicLossScale
from trainer.run.guard import DivergenceError, StepGuard

CPU = torch.device("cpu")


def test_unscale_divides_by_the_scale_and_flags_nothing_when_finite():
    ls = DynamicLossScale(CPU, init_scale=1024.0)
    grads = [torch.full((3,), 2048.0), None, torch.full((2, 2), -512.0)]
    found = ls.unscale_(grads)
    assert float(found) == 0.0
    assert torch.equal(grads[0], torch.full((3,), 2.0))
    assert torch.equal(grads[2], torch.full((2, 2), -0.5))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_unscale_flags_any_non_finite_gradient(bad):
    ls = DynamicLossScale(CPU, init_scale=8.0)
    found = ls.unscale_([torch.ones(4), torch.tensor([1.0, bad])])
    assert float(found) == 1.0


def test_update_backs_off_on_overflow_and_grows_after_the_interval():
    ls = DynamicLossScale(CPU, init_scale=64.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ls.update(torch.tensor(1.0))
    assert float(ls.scale) == 32.0 and int(ls.growth_tracker) == 0
    for _ in range(2):
        ls.update(torch.tensor(0.0))
    assert float(ls.scale) == 32.0 and int(ls.growth_tracker) == 2
    ls.update(torch.tensor(0.0))
    assert float(ls.scale) == 64.0 and int(ls.growth_tracker) == 0
    ls.update(torch.tensor(0.0))
    ls.update(torch.tensor(3.0))  # an agreed MAX of flags: any value > 0 is an overflow
    assert float(ls.scale) == 32.0 and int(ls.growth_tracker) == 0


def test_state_round_trip_is_exact():
    a = DynamicLossScale(CPU, init_scale=2.0**16, growth_interval=5)
    for flag in (1.0, 0.0, 0.0):
        a.update(torch.tensor(flag))
    b = DynamicLossScale(CPU, growth_interval=5)
    b.load_state_dict(a.state_dict())
    assert float(b.scale) == float(a.scale) == 2.0**15
    assert int(b.growth_tracker) == int(a.growth_tracker) == 2


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"init_scale": 0.0}, "initial loss scale 0.0"),
        ({"growth_factor": 1.0}, "growth factor 1.0"),
        ({"backoff_factor": 1.5}, "backoff factor 1.5"),
        ({"growth_interval": 0}, "growth interval 0"),
    ],
)
def test_bad_settings_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DynamicLossScale(CPU, **kwargs)


# The step guard's side of fp16 (trainer/run/guard.py): an overflow skips, never diverges.


def _check(guard: StepGuard, step: int, loss: float, norm: float, overflow: float):
    return guard.check(step, torch.tensor(loss), torch.tensor(norm), torch.tensor(overflow))


def test_overflow_skips_without_counting_as_divergence_even_with_nan_policy_stop():
    guard = StepGuard("stop", max_consecutive_skips=1, device=CPU)
    for step in (1, 2, 3):  # more overflows in a row than nan_max_consecutive_skips: no error
        verdict = _check(guard, step, 5.0, math.inf, 1.0)  # overflowed grads: the norm is inf too
        assert (verdict.apply, verdict.overflow) == (False, True)
        assert float(verdict.agreed_overflow) == 1.0
    verdict = _check(guard, 4, 5.0, 2.0, 0.0)
    assert (verdict.apply, verdict.overflow, float(verdict.agreed_overflow)) == (True, False, 0.0)
    assert (guard.overflows, guard.skipped) == (3, 0)


def test_non_finite_loss_under_fp16_follows_nan_policy():
    with pytest.raises(DivergenceError, match=r"step 7: non-finite loss and grad norm \(nan_policy=stop\)"):
        _check(StepGuard("stop", 5, CPU), 7, math.nan, math.nan, 1.0)
    guard = StepGuard("skip", max_consecutive_skips=1, device=CPU)
    verdict = _check(guard, 1, math.inf, math.nan, 1.0)
    assert (verdict.apply, verdict.overflow, float(verdict.agreed_overflow)) == (False, False, 1.0)
    _check(guard, 2, 5.0, math.inf, 1.0)  # an overflow between: neither counts nor resets the run
    with pytest.raises(DivergenceError, match=r"2 consecutive steps"):
        _check(guard, 3, math.nan, math.nan, 1.0)
    assert (guard.skipped, guard.overflows) == (2, 1)
