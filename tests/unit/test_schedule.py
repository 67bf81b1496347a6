"""Schedules as data: golden tables from the papers, the validator on good and broken schedules."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from parallel.pipeline.schedule import (
    GRAD_REDUCE,
    SCHEDULES,
    Action,
    ActionType,
    Placement,
    ScheduleError,
    build_schedule,
    forward_only,
    placement_for,
)
from parallel.pipeline.validate import (
    compute_order,
    format_schedule,
    peer_action,
    recognise_placement,
    validate_schedule,
    walk_ranks,
)

# p: pipeline ranks, m: micro-batches, v: virtual stages per rank


def orders(name: str, p: int, m: int, v: int = 1) -> list[str]:
    return [compute_order(actions) for actions in build_schedule(name, p, m, v)]


def parse(*ranks: str) -> list[list[Action]]:
    return [[Action.parse(t) for t in line.split()] for line in ranks]


def text(schedule: list[list[Action]]) -> list[str]:
    return [" ".join(map(str, actions)) for actions in schedule]


def valid_cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in SCHEDULES:
        for p in (1, 2, 4):
            for m in (1, 2, 4, 8):
                if name == "interleaved_1f1b":
                    if m % p == 0:
                        cases.append((name, p, m, 2))
                elif name == "zbv":
                    cases.append((name, p, m, 2))
                else:
                    cases.append((name, p, m, 1))
    return cases


# ---------------------------------------------------------------------------
# Actions and placement


def test_action_str_and_parse_roundtrip() -> None:
    for t in ("F2.3", "B0.0", "I1.7", "W3.2", "SF0.1", "RF1.1", "SB4.0", "RB12.9", "GR"):
        assert str(Action.parse(t)) == t
    assert Action.parse("F2.3") == Action(ActionType.FORWARD, 2, 3)
    assert Action.parse("GR") is GRAD_REDUCE


@pytest.mark.parametrize("bad", ["X0.1", "F0", "F-1.0", "SF.1", ""])
def test_action_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(bad)


def test_interleaved_placement() -> None:
    placement = Placement(4, 2)
    assert [placement.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert placement.stages_of(1) == [1, 5]
    assert Placement(1, 3).stages_of(0) == [0, 1, 2]
    assert placement_for("interleaved_1f1b", 4, 2) == placement
    assert placement_for("1f1b", 4) == Placement(4, 1)


def test_v_placement() -> None:
    # ZB-V: chunk 0 runs down the ranks, chunk 1 back up; the turn (stages 3, 4) is on
    # rank 3, and the first and last stage (the tied embedding) share rank 0.
    placement = placement_for("zbv", 4, 2)
    assert placement == Placement(4, 2, v_shape=True)
    assert [placement.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [placement.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert not placement.is_remote(4, 3) and placement.is_remote(4, 2) and not placement.is_remote(8, 0)
    assert Placement(1, 2, v_shape=True).stages_of(0) == [0, 1]
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'zb-v'"):
        placement_for("zb-v", 4, 2)
    with pytest.raises(ValueError, match=r"p >= 1 ranks and v >= 1 stages per rank; got p=0, v=2"):
        Placement(0, 2)


# ---------------------------------------------------------------------------
# Golden tables. Each was derived from the paper's rule and then compared.


def test_gpipe_p2_m2() -> None:
    # GPipe: every forward, then backwards in reverse micro-batch order.
    assert orders("gpipe", 2, 2) == ["F0.0 F0.1 B0.1 B0.0", "F1.0 F1.1 B1.1 B1.0"]


def test_1f1b_p2_m4() -> None:
    # Rank 0 warms up with p-r-1 = 1 forward; rank 1 (last) alternates from the start.
    assert orders("1f1b", 2, 4) == [
        "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3",
        "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3",
    ]


def test_1f1b_p4_m4() -> None:
    # Warm-ups 3, 2, 1, 0; m = p so rank 0 has a single steady step (F0.3 B0.0).
    assert orders("1f1b", 4, 4) == [
        "F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3",
        "F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 B1.2 B1.3",
        "F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 B2.3",
        "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3",
    ]


def test_interleaved_p2_m4_v2() -> None:
    # Megatron (Narayanan et al. 2021, fig 4): rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
    # Forwards visit chunk 0 for mbs 0-1, chunk 1 for mbs 0-1, then mbs 2-3; backwards the same
    # groups with chunks reversed. Warm-up: 2(p-r-1) + (v-1)p = 4 on rank 0, 2 on rank 1.
    assert orders("interleaved_1f1b", 2, 4, 2) == [
        "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
        "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3",
    ]


def test_zero_bubble_p2_m4() -> None:
    # ZB-H1: 1F1B's F/I order; rank r holds back its first r W's. The last rank runs
    # F I F I W ... so I's go up the pipe sooner; its held-back W fills the tail.
    assert orders("zero_bubble", 2, 4) == [
        "F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 F0.3 I0.2 W0.2 I0.3 W0.3",
        "F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 F1.3 I1.3 W1.2 W1.3",
    ]


def test_zero_bubble_p4_m4_defers_r_weight_grads() -> None:
    assert orders("zero_bubble", 4, 4) == [
        "F0.0 F0.1 F0.2 F0.3 I0.0 W0.0 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3",
        "F1.0 F1.1 F1.2 I1.0 F1.3 I1.1 W1.0 I1.2 W1.1 I1.3 W1.2 W1.3",
        "F2.0 F2.1 I2.0 F2.2 I2.1 F2.3 I2.2 W2.0 I2.3 W2.1 W2.2 W2.3",
        "F3.0 I3.0 F3.1 I3.1 F3.2 I3.2 F3.3 I3.3 W3.0 W3.1 W3.2 W3.3",
    ]


def test_zbv_p2_m4() -> None:
    # ZB-V (Qi et al. 2024 sec 6, PyTorch's ScheduleZBVZeroBubble): rank 0 holds stages 0 and 3,
    # rank 1 stages 1 and 2. Rank 0 warms up with 2(p-r)-1 = 3 chunk-0 forwards, then F I W on
    # chunk 1 (the loss stage) p-r = 2 times; rank 1 with one chunk-0 forward, r = 1 pair
    # (F2, F1), then F I W on chunk 1. Steady state: F I W per chunk; cool-down: rank 1 runs
    # the I's of both chunks first (I1.2 I2.3 I1.3), its W's fill the tail.
    assert orders("zbv", 2, 4, 2) == [
        "F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I3.1 W3.1 F0.3 I0.0 W0.0 F3.2 I3.2 W3.2 "
        "I0.1 W0.1 F3.3 I3.3 W3.3 I0.2 W0.2 I0.3 W0.3",
        "F1.0 F2.0 F1.1 F2.1 I2.0 W2.0 F1.2 I1.0 W1.0 F2.2 I2.1 W2.1 F1.3 I1.1 W1.1 "
        "F2.3 I2.2 W2.2 I1.2 I2.3 I1.3 W1.2 W2.3 W1.3",
    ]


def test_zbv_p4_m4_drops_the_missing_microbatches() -> None:
    # m < 2p - 1: the order of 2p - 1 = 7 micro-batches with mbs 4..6 left out, as PyTorch does.
    assert orders("zbv", 4, 4, 2) == [
        "F0.0 F0.1 F0.2 F0.3 F7.0 I7.0 W7.0 F7.1 I7.1 W7.1 F7.2 I7.2 W7.2 F7.3 I7.3 W7.3 "
        "I0.0 W0.0 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3",
        "F1.0 F1.1 F1.2 F1.3 F6.0 F6.1 I6.0 W6.0 F6.2 I6.1 W6.1 F6.3 I6.2 W6.2 I1.0 W1.0 "
        "I6.3 W6.3 I1.1 W1.1 I1.2 W1.2 I1.3 W1.3",
        "F2.0 F2.1 F2.2 F5.0 F2.3 F5.1 F5.2 I5.0 W5.0 F5.3 I5.1 W5.1 I2.0 W2.0 I5.2 W5.2 "
        "I2.1 W2.1 I5.3 W5.3 I2.2 W2.2 I2.3 W2.3",
        "F3.0 F4.0 F3.1 F4.1 F3.2 F4.2 F3.3 F4.3 I4.0 W4.0 I3.0 W3.0 I4.1 W4.1 I3.1 W3.1 "
        "I4.2 W4.2 I3.2 W3.2 I4.3 W4.3 I3.3 W3.3",
    ]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_zbv_orders_equal_pytorch(p: int) -> None:
    # The same compute order as torch.distributed.pipelining's ScheduleZBVZeroBubble, whose
    # per-rank generator needs only these three attributes of the schedule object; its
    # actions print as "<stage><F|I|W><micro-batch>" (e.g. "3I2").
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    generate = ScheduleZBVZeroBubble._calculate_single_rank_operations
    for m in range(1, 3 * p + 2):
        fake = SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
        theirs = [
            " ".join(
                re.sub(r"^(\d+)([FIW])(\d+)$", r"\2\1.\3", str(a)) for a in generate(fake, r) if a is not None
            )
            for r in range(p)
        ]
        assert orders("zbv", p, m, 2) == theirs, f"p={p} m={m}"


def test_zbv_validates_on_a_grid() -> None:
    # Odd p and every m around 2p - 1 (where the dropped micro-batches start), beyond valid_cases.
    for p in (3, 5):
        for m in range(1, 2 * p + 2):
            validate_schedule(build_schedule("zbv", p, m, 2), p, m, 2, placement_for("zbv", p, 2))


def test_zbv_comm_skips_the_turn_of_the_v() -> None:
    # Stages p-1 and p share rank p-1: nothing is sent between them. Rank 0 receives the
    # activation of stage 3 from rank 1 and sends nothing out of stage 3 (the last stage).
    p, m = 2, 4
    lines = format_schedule(build_schedule("zbv", p, m, 2), comm=True).splitlines()
    assert lines[1].startswith("rank 1: [RF1.0] F1.0  F2.0  [RF1.1 SF2.0] F1.1  F2.1  [RB2.0] I2.0")
    comm = [a for actions in build_schedule("zbv", 4, 8, 2) for a in actions if a.type.is_comm]
    assert not any(a.stage in (3, 4) and peer_action(a).stage in (3, 4) for a in comm)
    assert not any(a.type is ActionType.SEND_FORWARD and a.stage == 7 for a in comm)


def test_forward_only_follows_the_placement() -> None:
    # Evaluation under the V: each rank runs its two stages per micro-batch, no p2p at the
    # turn, and the batched comm completes (one global message order).
    v_shape = placement_for("zbv", 3, 2)
    schedule = forward_only(v_shape, 2)
    assert [compute_order(a) for a in schedule] == [
        "F0.0 F5.0 F0.1 F5.1",
        "F1.0 F4.0 F1.1 F4.1",
        "F2.0 F3.0 F2.1 F3.1",
    ]
    assert " ".join(map(str, schedule[2][:4])) == "RF2.0 F2.0 F3.0 SF3.0"
    posted: set[Action] = set()

    def try_batch(rank: int, batch: Sequence[Action]) -> bool:
        posted.update(batch)
        return all(peer_action(a) in posted for a in batch)

    for placement in (v_shape, Placement(3, 2), placement_for("zbv", 4, 2)):
        for m in (1, 3):
            posted.clear()
            schedule = forward_only(placement, m)
            assert walk_ranks(schedule, lambda r, a: None, try_batch) == [len(a) for a in schedule]


def test_comm_golden_gpipe_p2_m2() -> None:
    # Sends follow their producer, recvs precede their consumer; the last stage goes
    # straight from F1.1 to B1.1 (same rank, no comm).
    assert text(build_schedule("gpipe", 2, 2)) == [
        "F0.0 SF0.0 F0.1 SF0.1 RB0.1 B0.1 RB0.0 B0.0 GR",
        "RF1.0 F1.0 RF1.1 F1.1 B1.1 SB1.1 B1.0 SB1.0 GR",
    ]


def test_comm_golden_1f1b_p2_m4_pairs_like_megatron() -> None:
    # Steady state batches are Megatron's send_forward_recv_backward on rank 0
    # ([RB0.i SF0.i+1]) and send_backward_recv_forward on rank 1 ([SB1.i RF1.i+1]).
    assert format_schedule(build_schedule("1f1b", 2, 4), comm=True).splitlines() == [
        "rank 0: F0.0  [SF0.0] F0.1  [RB0.0 SF0.1] B0.0  F0.2  [RB0.1 SF0.2] B0.1  F0.3  "
        "[RB0.2 SF0.3] B0.2  [RB0.3] B0.3  GR",
        "rank 1: [RF1.0] F1.0  B1.0  [SB1.0 RF1.1] F1.1  B1.1  [SB1.1 RF1.2] F1.2  B1.2  "
        "[SB1.2 RF1.3] F1.3  B1.3  [SB1.3] GR",
    ]


def test_single_rank_has_no_comm() -> None:
    for name in ("gpipe", "1f1b", "zero_bubble"):
        assert all(not a.type.is_comm for a in build_schedule(name, 1, 3)[0])
    assert orders("gpipe", 1, 3) == ["F0.0 F0.1 F0.2 B0.2 B0.1 B0.0"]
    # 1F1B's warm-up is p - r - 1 = 0: one micro-batch in flight at a time.
    assert orders("1f1b", 1, 3) == ["F0.0 B0.0 F0.1 B0.1 F0.2 B0.2"]


# ---------------------------------------------------------------------------
# Every generated schedule validates


@pytest.mark.parametrize("name,p,m,v", valid_cases())
def test_generated_schedules_validate(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    stats = validate_schedule(schedule, p, m, v)
    assert all(actions[-1] is GRAD_REDUCE for actions in schedule)
    if name in ("1f1b", "zero_bubble"):
        assert stats.peak_in_flight == [min(p - r, m) for r in range(p)]
    if name == "gpipe":
        assert stats.peak_in_flight == [m] * p
    if name == "zbv":
        # Half-stage chunks: 2p of them on every rank once m >= 2p - 1, i.e. the activation
        # memory 1F1B holds on its first rank (p full stages), now on every rank.
        assert all(peak <= min(2 * p, 2 * m) for peak in stats.peak_in_flight)
        if m >= 2 * p - 1:
            assert stats.peak_in_flight == [2 * p] * p
        recognised = recognise_placement(schedule, p, v)
        assert [recognised.rank_of(s) for s in range(2 * p)] == [*range(p), *reversed(range(p))]
    for r in range(p):
        forwards = stats.action_counts[r][ActionType.FORWARD]
        assert forwards == m * v


def test_build_schedule_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'.*'1f1b'"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match=r"m=0 must be >= 1"):
        build_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match=r"p=0 must be >= 1"):
        build_schedule("gpipe", 0, 4)
    with pytest.raises(ValueError, match=r"needs v >= 2.*v=1"):
        build_schedule("interleaved_1f1b", 2, 4, 1)
    with pytest.raises(
        ValueError, match=r"m=6 must be a multiple of pipeline_parallel_size p=4 \(m % p = 2\)"
    ):
        build_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match=r"zero_bubble: supports only v=1.*v=2"):
        build_schedule("zero_bubble", 2, 4, 2)
    for v in (1, 3):
        with pytest.raises(ValueError, match=rf"zbv: needs exactly v=2 stages per rank .*got v={v}"):
            build_schedule("zbv", 2, 4, v)


def test_format_schedule_one_line_per_rank() -> None:
    lines = format_schedule(build_schedule("1f1b", 4, 8)).splitlines()
    assert len(lines) == 4
    assert lines[3].startswith("rank 3: F3.0  B3.0")


# ---------------------------------------------------------------------------
# Broken schedules are rejected with the right message

GPIPE_2_2 = (
    "F0.0 SF0.0 F0.1 SF0.1 RB0.1 B0.1 RB0.0 B0.0 GR",
    "RF1.0 F1.0 RF1.1 F1.1 B1.1 SB1.1 B1.0 SB1.0 GR",
)


def test_handwritten_gpipe_is_valid() -> None:
    validate_schedule(parse(*GPIPE_2_2), 2, 2)


def test_dropped_action() -> None:
    broken = parse(GPIPE_2_2[0].replace(" B0.0 GR", " GR"), GPIPE_2_2[1])
    with pytest.raises(ScheduleError, match=r"missing action B0.0"):
        validate_schedule(broken, 2, 2)


def test_duplicated_action() -> None:
    broken = parse(GPIPE_2_2[0].replace("F0.1", "F0.1 F0.1", 1), GPIPE_2_2[1])
    with pytest.raises(ScheduleError, match=r"duplicate action F0.1 on rank 0 \(positions 2 and 3\)"):
        validate_schedule(broken, 2, 2)


def test_action_on_wrong_rank() -> None:
    broken = parse(GPIPE_2_2[0], GPIPE_2_2[1] + " F0.0")
    with pytest.raises(ScheduleError, match=r"F0.0 runs on rank 1 .* stage 0 lives on rank 0"):
        validate_schedule(broken, 2, 2)
    # A ZB-V schedule checked against the interleaved placement: stage 3 is not on rank 1 there.
    with pytest.raises(ScheduleError, match=r"F3.0 runs on rank 0 .* stage 3 lives on rank 1"):
        validate_schedule(build_schedule("zbv", 2, 4, 2), 2, 4, 2, placement_for("1f1b", 2, 2))


def test_backward_before_its_forward() -> None:
    broken = parse(GPIPE_2_2[0], "RF1.0 F1.0 RF1.1 B1.1 F1.1 SB1.1 B1.0 SB1.0 GR")
    with pytest.raises(
        ScheduleError, match=r"dependency violated on rank 1: B1.1 at position 3 runs before F1.1"
    ):
        validate_schedule(broken, 2, 2)


def test_forward_before_its_recv() -> None:
    broken = parse(GPIPE_2_2[0], "F1.0 RF1.0 RF1.1 F1.1 B1.1 SB1.1 B1.0 SB1.0 GR")
    with pytest.raises(ScheduleError, match=r"F1.0 at position 0 runs before RF1.0 at position 1"):
        validate_schedule(broken, 2, 2)


def test_missing_recv_is_a_dependency_error() -> None:
    broken = parse(GPIPE_2_2[0], GPIPE_2_2[1].replace("RF1.1 ", ""))
    with pytest.raises(ScheduleError, match=r"F1.1 on rank 1 at position 2 needs RF1.1 before it"):
        validate_schedule(broken, 2, 2)


def test_unmatched_recv() -> None:
    broken = parse(GPIPE_2_2[0].replace("SF0.1 ", ""), GPIPE_2_2[1])
    with pytest.raises(ScheduleError, match=r"recv RF1.1 on rank 1 has no matching SF0.1 on rank 0"):
        validate_schedule(broken, 2, 2)


def test_comm_between_stages_of_one_rank() -> None:
    broken = parse("F0.0 SF0.0 F1.0 B1.0 B0.0 GR")
    with pytest.raises(ScheduleError, match=r"SF0.0 on rank 0: stage 1 is not a stage on another rank"):
        validate_schedule(broken, 1, 1, 2)


def test_deadlocking_order() -> None:
    # Rank 1 wants micro-batch 1 first, rank 0 sends micro-batch 0 first: each
    # batch waits for a peer op the other rank only posts after its own batch.
    broken = parse(GPIPE_2_2[0], "RF1.1 F1.1 RF1.0 F1.0 B1.1 SB1.1 B1.0 SB1.0 GR")
    with pytest.raises(
        ScheduleError, match=r"deadlock.*rank 0 blocked at position 1 on \[SF0.0\] waiting for RF1.0"
    ):
        validate_schedule(broken, 2, 2)


def test_recv_before_send_in_separate_batches_deadlocks() -> None:
    # p=2, m=1 with rank 0 waiting for the grad (RB0.0) before it sends the
    # activation (SF0.0) that rank 1 needs to produce that grad. Each rank's own
    # order is fine; only the cross-rank wait cycle is wrong.
    broken = parse("F0.0 RB0.0 B0.0 SF0.0 GR", "RF1.0 F1.0 B1.0 SB1.0 GR")
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 .* waiting for SB1.0 on rank 1; rank 1 .*"):
        validate_schedule(broken, 2, 1)


def test_walk_ranks_retries_a_refused_batch_and_reports_where_ranks_stop() -> None:
    # The walk the deadlock check and the simulator share: rank 0's [SF0.0] is
    # refused on the first sweep (RF1.0 not posted yet) and passes on the next.
    posted: set[Action] = set()
    events: list[str] = []

    def try_batch(rank: int, batch: Sequence[Action]) -> bool:
        posted.update(batch)
        events.append(f"try {rank} " + " ".join(map(str, batch)))
        return all(peer_action(a) in posted for a in batch)

    def on_compute(rank: int, action: Action) -> None:
        events.append(f"run {rank} {action}")

    stop = walk_ranks(parse("F0.0 SF0.0 GR", "RF1.0 F1.0 GR"), on_compute, try_batch)
    assert stop == [3, 3]
    assert events == [
        "run 0 F0.0", "try 0 SF0.0", "try 1 RF1.0", "run 1 F1.0", "run 1 GR", "try 0 SF0.0", "run 0 GR",
    ]  # fmt: skip
    posted.clear()
    deadlocked = parse("F0.0 RB0.0 B0.0 SF0.0 GR", "RF1.0 F1.0 B1.0 SB1.0 GR")
    assert walk_ranks(deadlocked, on_compute, try_batch) == [1, 0]  # each stuck at its first batch


def test_pair_order_mismatch_inside_a_batch() -> None:
    # Interleaved p=2: rank 0 sends an activation (SF0.2) and an input grad (SB2.0)
    # to rank 1 in one batch, and rank 1 receives them in that order. NCCL matches
    # p2p in posting order, so swapping them would hand each tensor to the wrong op.
    schedule = build_schedule("interleaved_1f1b", 2, 4, 2)
    rank0 = schedule[0]
    i = rank0.index(Action.parse("SF0.2"))
    assert rank0[i + 1] == Action.parse("SB2.0")
    rank0[i], rank0[i + 1] = rank0[i + 1], rank0[i]
    with pytest.raises(
        ScheduleError, match=r"p2p order mismatch from rank 0 to rank 1: message #\d+ is SB2.0"
    ):
        validate_schedule(schedule, 2, 4, 2)


def test_grad_reduce_rules() -> None:
    no_reduce = parse(GPIPE_2_2[0].replace(" GR", ""), GPIPE_2_2[1])
    with pytest.raises(ScheduleError, match=r"rank 0 has 0 GRAD_REDUCE"):
        validate_schedule(no_reduce, 2, 2)
    twice = parse(GPIPE_2_2[0] + " GR", GPIPE_2_2[1])
    with pytest.raises(ScheduleError, match=r"rank 0 has 2 GRAD_REDUCE"):
        validate_schedule(twice, 2, 2)
    early = parse("F0.0 I0.0 GR W0.0")
    with pytest.raises(ScheduleError, match=r"GRAD_REDUCE on rank 0 at position 2 comes before W0.0"):
        validate_schedule(early, 1, 1)


def test_half_split_backward_is_missing_its_weight_grad() -> None:
    with pytest.raises(ScheduleError, match=r"missing action W0.0"):
        validate_schedule(parse("F0.0 I0.0 GR"), 1, 1)
