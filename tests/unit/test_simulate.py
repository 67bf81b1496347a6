"""The pure simulator against the bubble theory and hand-computed timelines."""

from __future__ import annotations

import pytest

from parallel.pipeline.schedule import ActionType, ScheduleError, build_schedule
from parallel.pipeline.simulate import SimResult, StageCosts, bubble_theory, simulate
from parallel.pipeline.validate import validate_schedule

# p: pipeline ranks, m: micro-batches, v: virtual stages per rank

PM = [(2, 1), (2, 2), (2, 4), (2, 8), (3, 5), (4, 4), (4, 8), (4, 16), (8, 16)]
# (F, I, W): F=1 with B=2, and F=B
COSTS = [(1.0, 1.0, 1.0), (1.0, 0.5, 0.5)]


def run(
    name: str, p: int, m: int, v: int = 1, f: float = 1.0, i: float = 1.0, w: float = 1.0, **kw: bool
) -> SimResult:
    costs = StageCosts.uniform(p * v, f / v, i / v, w / v)
    return simulate(build_schedule(name, p, m, v), p, m, v, costs, **kw)


def test_gpipe_by_hand() -> None:
    # p=2, m=2, F=1, B=2: rank 1 runs F1.0 [1,2] F1.1 [2,3] B1.1 [3,5] B1.0 [5,7];
    # rank 0 runs B0.1 [5,7] B0.0 [7,9]. Makespan (m+p-1)(F+B) = 9, each rank busy 6,
    # so idle 6 of 2*9: bubble 1/3 = (p-1)/(m+p-1).
    result = run("gpipe", 2, 2)
    assert result.makespan == 9.0
    assert result.busy == [6.0, 6.0]
    assert result.idle == [3.0, 3.0]
    assert result.bubble_fraction == pytest.approx(1 / 3)
    spans = {(e.rank, str(e.action)): (e.start, e.end) for e in result.timeline}
    assert spans[(1, "B1.1")] == (3.0, 5.0)
    assert spans[(0, "B0.0")] == (7.0, 9.0)


@pytest.mark.parametrize("rendezvous", [False, True])
@pytest.mark.parametrize("f,i,w", COSTS)
@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_match_theory(
    name: str, p: int, m: int, f: float, i: float, w: float, rendezvous: bool
) -> None:
    # Balanced stages, free links: forwards and backwards each cross the pipe without
    # gaps, so makespan = (m + p - 1)(F + B) and idle / (p * makespan) = (p-1)/(m+p-1).
    result = run(name, p, m, 1, f, i, w, rendezvous=rendezvous)
    assert result.makespan == pytest.approx((m + p - 1) * (f + i + w))
    assert result.bubble_fraction == pytest.approx(bubble_theory(p, m), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_beats_1f1b(p: int, m: int) -> None:
    zb = run("zero_bubble", p, m)
    one_f_one_b = run("1f1b", p, m)
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    # ZB-H1 (Qi et al. 2023, sec 3.1): bubble (p-1)(F + I - W) per rank instead of (p-1)(F + I + W).
    assert zb.makespan == pytest.approx(3 * m + (p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_interleaved_beats_1f1b(p: int, m: int) -> None:
    # Each of the v=2 chunks costs half a 1F1B stage, so the work per rank is equal.
    interleaved = run("interleaved_1f1b", p, m, 2)
    assert interleaved.bubble_fraction < run("1f1b", p, m).bubble_fraction
    assert interleaved.bubble_fraction == pytest.approx(bubble_theory(p, m, 2), abs=1e-12)


@pytest.mark.parametrize("rendezvous", [False, True])
def test_zbv_matches_its_theory(rendezvous: bool) -> None:
    # ZB-V with F = I = W: each rank idles only the V's fill, (p-1)/2 stage-times, once m is
    # large enough (m >= 2p - 1), so the makespan is 3m + (p-1)/2; fewer micro-batches leave
    # the empty slots of the 2p - 1 order (bubble_theory's docstring).
    for p in range(1, 7):
        for m in range(1, 3 * p + 2):
            result = run("zbv", p, m, 2, rendezvous=rendezvous)
            assert result.bubble_fraction == pytest.approx(bubble_theory(p, m, 2, "zbv"), abs=1e-12)
            if m >= 2 * p - 1:
                assert result.makespan == pytest.approx(3 * m + (p - 1) / 2)
                assert result.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zbv_halves_the_zero_bubble_bubble(p: int, m: int) -> None:
    # Same work per rank (two half-stage chunks); with m >= 2p - 1 ZB-V idles (p-1)/2 where
    # ZB-H1 idles p-1; with fewer micro-batches it is never worse.
    zbv, zb = run("zbv", p, m, 2), run("zero_bubble", p, m)
    assert zbv.bubble_fraction <= zb.bubble_fraction + 1e-12
    if m >= 2 * p - 1:
        assert zb.makespan - 3 * m == pytest.approx(2 * (zbv.makespan - 3 * m))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (8, 4)])
def test_peak_in_flight(p: int, m: int) -> None:
    # 1F1B caps rank 0 at p micro-batches; GPipe holds all m.
    assert run("1f1b", p, m).peak_activation_bytes[0] == min(p, m)
    assert run("gpipe", p, m).peak_activation_bytes[0] == m
    assert run("zero_bubble", p, m).peak_activation_bytes[0] == min(p, m)
    if m >= 2 * p - 1:  # ZB-V: 2p half-stage chunks on every rank, 1F1B's rank-0 peak
        assert run("zbv", p, m, 2).peak_activation_bytes == [2 * p] * p
    assert validate_schedule(build_schedule("1f1b", p, m), p, m).peak_in_flight[0] == min(p, m)


def test_activation_bytes_weight_the_peak() -> None:
    costs = StageCosts([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], activation_bytes=[100.0, 10.0])
    result = simulate(build_schedule("1f1b", 2, 4), 2, 4, 1, costs)
    assert result.peak_activation_bytes == [200.0, 10.0]


def test_link_time_adds_to_the_critical_path() -> None:
    # p=2, m=1: F0.0, link, F1.0, B1.0, link, B0.0.
    costs = StageCosts([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], link=0.5)
    result = simulate(build_schedule("1f1b", 2, 1), 2, 1, 1, costs)
    assert result.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


@pytest.mark.parametrize(
    "name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zbv", 2)]
)
def test_rendezvous_never_beats_buffered_sends(name: str, v: int) -> None:
    # Uneven stages: a blocking send can only add waiting, never remove it.
    n = 4 * v
    costs = StageCosts([1.0 + s % 3 for s in range(n)], [1.5] * n, [0.5 + s % 2 for s in range(n)], link=0.1)
    schedule = build_schedule(name, 4, 8, v)
    buffered = simulate(schedule, 4, 8, v, costs)
    blocking = simulate(schedule, 4, 8, v, costs, rendezvous=True)
    assert blocking.makespan >= buffered.makespan - 1e-9
    assert blocking.busy == pytest.approx(buffered.busy)


def test_timeline_holds_each_compute_once() -> None:
    result = run("zero_bubble", 4, 8)
    computes = [e for e in result.timeline if e.action.type.is_compute]
    assert len(computes) == 4 * 8 * 3
    assert len({(e.rank, e.action) for e in computes}) == len(computes)
    assert all(e.end > e.start for e in computes)
    weights = [e for e in computes if e.action.type is ActionType.BACKWARD_WEIGHT]
    assert len(weights) == 4 * 8


def test_bubble_theory_formula() -> None:
    assert bubble_theory(1, 8) == 0.0
    assert bubble_theory(4, 8) == pytest.approx(3 / 11)
    assert bubble_theory(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_theory(4, 8, 2, "zbv") == pytest.approx(3 / 51)  # (p-1) / (6m + p - 1)
    assert bubble_theory(4, 4, 2, "zbv") == pytest.approx(3 / 15)  # idle 2p-1-m = 3 of 3m + 3
    assert bubble_theory(1, 1, 2, "zbv") == 0.0
    with pytest.raises(ValueError, match="m=0"):
        bubble_theory(4, 0)


def test_cost_list_length_is_checked() -> None:
    with pytest.raises(ValueError, match=r"StageCosts.forward has 2 entries but there are n=4 stages"):
        simulate(build_schedule("1f1b", 4, 4), 4, 4, 1, StageCosts.uniform(2))


def test_deadlock_is_reported() -> None:
    from parallel.pipeline.schedule import Action

    broken = [
        [Action.parse(t) for t in "F0.0 RB0.0 B0.0 SF0.0 GR".split()],
        [Action.parse(t) for t in "RF1.0 F1.0 B1.0 SB1.0 GR".split()],
    ]
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(broken, 2, 1, 1, StageCosts.uniform(2))
