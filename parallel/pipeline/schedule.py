"""Pipeline schedules as data: the generators, and each schedule's stage placement.

This module owns *what* each pipeline rank does and in which order; it never
runs anything. A schedule is ``list[list[Action]]`` (the vocabulary is
``parallel/pipeline/actions.py``, re-exported here): one ordered list per rank
(torchgpipe's ``clock_cycles``, PyTorch pipelining's ``2F0`` actions). The
executor (``parallel/pipeline/executor.py``) and the simulator (``parallel/pipeline/simulate.py``)
both walk these lists verbatim, so the order, the p2p pairing and the place of
the gradient reduce are decided here once. Pure Python: no torch.

Placement: which rank holds which stage is part of the schedule, named once by
`placement_for` (``parallel.pipeline.actions.Placement``): Megatron's interleaved one
(stage ``s`` on rank ``s % p``; with v == 1 stage == rank) for every schedule but
ZB-V, whose V puts stages ``r`` and ``2p - 1 - r`` on rank ``r``.

Comm: ``SF s.mb`` sends stage s's output to ``RF s+1.mb``, ``SB s.mb`` sends the
grad of stage s's input to ``RB s-1.mb``; each maximal run of consecutive comm
actions is posted as one batch. ``parallel/pipeline/validate.py`` states this convention
and the batched-p2p (deadlock) semantics in full, and ``validate_schedule``
checks them on any schedule (it also prints schedules, ``format_schedule``);
``_attach_comm`` below places the comm so that the generated schedules pass by
construction.

GRAD_REDUCE is the last action of every rank: the executor all-reduces the
data-parallel and tied-embedding gradients there, once every weight gradient of
the flush is final. Its stage and micro-batch are ``-1`` (it covers all the
rank's stages).
"""

from __future__ import annotations

from collections.abc import Callable

# The vocabulary lives in parallel.pipeline.actions; re-exported here, where schedules are made.
from parallel.errors import ParallelConfigError
from parallel.pipeline.actions import (
    GRAD_REDUCE,
    INPUT_GRAD_TYPES,
    WEIGHT_GRAD_TYPES,
    Action,
    ActionType,
    Message,
    Placement,
    Schedule,
    ScheduleError,
    message,
)

__all__ = [
    "GRAD_REDUCE",
    "INPUT_GRAD_TYPES",
    "SCHEDULES",
    "WEIGHT_GRAD_TYPES",
    "Action",
    "ActionType",
    "Message",
    "Placement",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "message",
    "one_f_one_b",
    "placement_for",
    "zbv",
    "zero_bubble",
]

# p: pipeline ranks, m: micro-batches, v: virtual stages per rank, n: stages (n = p * v)


# ---------------------------------------------------------------------------
# Compute orders. Each returns, per rank, the compute actions only; comm and
# GRAD_REDUCE are added by `_attach_comm`, the same way for every schedule.


def _f(stage: int, mb: int) -> Action:
    return Action(ActionType.FORWARD, stage, mb)


def _b(stage: int, mb: int) -> Action:
    return Action(ActionType.BACKWARD, stage, mb)


def _gpipe_order(p: int, m: int) -> Schedule:
    # GPipe (Huang et al. 2019): all forwards, then all backwards in reverse
    # micro-batch order, as autograd would run them on the concatenated batch;
    # the last stage can then start B(m-1) right after F(m-1).
    return [[_f(r, i) for i in range(m)] + [_b(r, i) for i in reversed(range(m))] for r in range(p)]


def _one_f_one_b_order(p: int, m: int) -> Schedule:
    # PipeDream-flush / Megatron non-interleaved (Narayanan et al. 2021, sec 2.2.1):
    # rank r runs p-r-1 warm-up forwards so at most p-r micro-batches are in flight.
    order: Schedule = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [_f(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [_f(r, warmup + i), _b(r, i)]
        ops += [_b(r, i) for i in range(m - warmup, m)]
        order.append(ops)
    return order


def _interleaved_chunk_mb(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """Megatron's k-th virtual micro-batch -> (model chunk, micro-batch).

    Micro-batches go through the chunks in groups of p: forward runs chunk 0 on
    mbs 0..p-1, chunk 1 on the same mbs, ..., then chunk 0 on mbs p..2p-1, ...;
    backward visits the chunks in reverse (Narayanan et al. 2021, sec 2.2, fig 4).
    """
    chunk = (k % (p * v)) // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk, (k // (p * v)) * p + k % p


def _interleaved_order(p: int, m: int, v: int) -> Schedule:
    # Megatron-LM `forward_backward_pipelining_with_interleaving`: warm-up of
    # 2(p-r-1) + (v-1)p virtual forwards, then 1F1B on virtual micro-batches.
    # Megatron runs *all* forwards first when m == p; we do not need that special
    # case: our comm placement (`_attach_comm`) is deadlock-free for any order.
    total = m * v
    order: Schedule = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)

        def fwd(k: int, r: int = r) -> Action:
            chunk, mb = _interleaved_chunk_mb(k, p, v, forward=True)
            return _f(chunk * p + r, mb)

        def bwd(k: int, r: int = r) -> Action:
            chunk, mb = _interleaved_chunk_mb(k, p, v, forward=False)
            return _b(chunk * p + r, mb)

        ops = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [fwd(warmup + k), bwd(k)]
        ops += [bwd(k) for k in range(total - warmup, total)]
        order.append(ops)
    return order


def _zero_bubble_order(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec 3.1, fig 3).

    1F1B with the backward split into I (input grad, on the critical path) and W
    (weight grad, free to move). Warm-up and the F/I order are those of 1F1B, so
    rank r holds at most p-r micro-batches in flight. Rank r holds back its
    first r W's: the I's then travel up the pipe one stage-time apart while the
    deferred W's fill what would be the 1F1B cool-down bubble, ending at the
    same time on every rank. Rank r then keeps <= r+1 micro-batches waiting for
    W and p-r in flight, so the peak over ranks is p, as in 1F1B. Bubble per
    rank: (p-1)(F + I - W) instead of 1F1B's (p-1)(F + I + W). Same order as
    torch.distributed.pipelining's ZB schedule with one stage per rank.
    """
    order: Schedule = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [_f(r, i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                ops.append(_f(r, warmup + i))
            ops.append(Action(ActionType.BACKWARD_INPUT, r, i))
            if i >= r:  # W of micro-batch i - r
                ops.append(Action(ActionType.BACKWARD_WEIGHT, r, i - r))
        ops += [Action(ActionType.BACKWARD_WEIGHT, r, j) for j in range(max(m - r, 0), m)]
        order.append(ops)
    return order


def _zbv_order(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec 6), as PyTorch's
    ``ScheduleZBVZeroBubble`` orders it. Rank r holds the V's two chunks, stage r
    (chunk 0, down the ranks) and stage 2p-1-r (chunk 1, back up)::

        rank 0   F0 ........................................... F7    stage 7: loss,
        rank 1      F1 ..................................... F6        turns into I7 I6 ...
        rank 2         F2 ............................... F5
        rank 3            F3  F4 (same rank: no p2p)

    Warm-up: 2(p-r)-1 chunk-0 forwards, then r (F chunk 1, F chunk 0) pairs, then p-r
    (F I W) on chunk 1; steady state: (F I W) on chunk 0 then on chunk 1; cool-down:
    r (I chunk 0, I chunk 1) pairs, p-r (I W) on chunk 0, and the held-back W's.
    With F = I = W and m >= 2p - 1 the only idle time is the V's fill, p-1 chunk
    forwards per rank (half of ZB-H1's; `parallel.pipeline.simulate.bubble_theory`), and
    every rank peaks at 2p chunks in flight, the activations 1F1B holds on its
    first rank. For fewer micro-batches the order is built for 2p - 1 and the
    missing ones are dropped (as PyTorch does): a subsequence of a valid order
    stays valid, only the bubble grows. Caveat (simulator): when I != W,
    `_attach_comm`, which times messages by a unit-cost ideal run, posts some of
    ZB-V's sends after a later compute and the idle then grows with m (p=4, m=16,
    I = 2F: bubble 0.123, vs 0.045 with each send right after its producer);
    ZB-H1's sends are not delayed so.
    """
    padded = max(m, 2 * p - 1)
    return [[a for a in _zbv_rank(r, p, padded) if a.microbatch < m] for r in range(p)]


def _zbv_rank(r: int, p: int, m: int) -> list[Action]:
    """Rank r's ZB-V compute order for m (>= 2p - 1) micro-batches; see `_zbv_order`."""
    f, i, w = ActionType.FORWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT
    stage = (r, 2 * p - 1 - r)  # chunk 0, chunk 1
    done = {f: [0, 0], i: [0, 0], w: [0, 0]}  # actions issued per (type, chunk)
    ops: list[Action] = []

    def run(*steps: tuple[ActionType, int]) -> None:
        for t, chunk in steps:
            ops.append(Action(t, stage[chunk], done[t][chunk]))
            done[t][chunk] += 1

    for _ in range(2 * (p - r) - 1):
        run((f, 0))
    for _ in range(r):
        run((f, 1), (f, 0))
    for _ in range(p - r):
        run((f, 1), (i, 1), (w, 1))
    while done[f][1] < done[f][0] or done[f][0] < m:
        if done[f][0] < m:
            run((f, 0))
        run((i, 0), (w, 0), (f, 1), (i, 1), (w, 1))
    for _ in range(r):
        run((i, 0), (i, 1))
    for _ in range(p - r):
        run((i, 0), (w, 0))
    for chunk in (1, 0):
        while done[w][chunk] < done[i][chunk]:
            run((w, chunk))
    return ops


def _attach_comm(order: Schedule, placement: Placement) -> Schedule:
    """Insert the p2p actions between the compute actions and end with GRAD_REDUCE.

    Each message gets a time: when its consumer starts in an ideal run (unit
    costs, free comm; `_ideal_end_times`). A recv goes right before its consumer
    and a send where its rank stands at that time (after the producer, which
    ended by then), so both sides post at about the moment the data is needed:
    a blocking send rarely waits for its recv. In 1F1B this yields Megatron's
    pairs, e.g. ``F [SF RB] B [SB RF] F``.

    Deadlock freedom by construction: every rank lists its comm ops in one
    global order (message time, then message id). Among the ops pending in
    blocked batches, take the one of the earliest message: its peer op sits in
    the peer's blocked batch or before it (the peer follows the same order), so
    it was posted: a contradiction. The same order makes each pair of ranks post
    its messages in one order, as NCCL's tag-less p2p matching needs.
    """
    ends = _ideal_end_times(order, placement)
    schedule: Schedule = []
    for rank, ops in enumerate(order):
        comm = sorted(_comm_ops(ops, rank, placement, ends), key=lambda c: (c[0], message(c[1])))
        out: list[Action] = []
        k = 0
        for action in [*ops, GRAD_REDUCE]:
            # a comm op goes before the first compute that ends after its time
            while k < len(comm) and (action is GRAD_REDUCE or comm[k][0] < ends[action]):
                out.append(comm[k][1])
                k += 1
            out.append(action)
        schedule.append(out)
    return schedule


# Per-stage costs of the ideal run that orders messages (F=1, B=2 as I+W).
_IDEAL_COST = {
    ActionType.FORWARD: 1.0,
    ActionType.BACKWARD: 2.0,
    ActionType.BACKWARD_INPUT: 1.0,
    ActionType.BACKWARD_WEIGHT: 1.0,
}


def _ideal_end_times(order: Schedule, placement: Placement) -> dict[Action, float]:
    """End time of each compute action when comm is free and instantaneous.

    Raises:
        ScheduleError: if the compute orders wait on each other in a cycle.
    """
    present = {a for ops in order for a in ops}
    ends: dict[Action, float] = {}
    clock, pc = [0.0] * placement.p, [0] * placement.p
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(order):
            while pc[rank] < len(ops):
                action = ops[pc[rank]]
                deps = [d for d in _remote_inputs(action, rank, placement) if d in present]
                if any(d not in ends for d in deps):
                    break
                start = max([clock[rank]] + [ends[d] for d in deps])
                clock[rank] = ends[action] = start + _IDEAL_COST[action.type]
                pc[rank] += 1
                progress = True
    stuck = [str(ops[pc[r]]) for r, ops in enumerate(order) if pc[r] < len(ops)]
    if stuck:
        raise ScheduleError(f"compute order cannot make progress; ranks wait on {stuck}")
    return ends


def _remote_inputs(action: Action, rank: int, placement: Placement) -> list[Action]:
    """Compute actions on other ranks whose output ``action`` consumes (B or I for a backward)."""
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD and placement.is_remote(s - 1, rank):
        return [_f(s - 1, mb)]
    if action.type in INPUT_GRAD_TYPES and placement.is_remote(s + 1, rank):
        return [_b(s + 1, mb), Action(ActionType.BACKWARD_INPUT, s + 1, mb)]
    return []


def _comm_ops(
    ops: list[Action], rank: int, placement: Placement, ends: dict[Action, float]
) -> list[tuple[float, Action]]:
    """(message time, op) for every send and recv of one rank; time = consumer's ideal start."""
    timed = []
    for action in ops:
        for send in _sends_after(action, rank, placement):
            consumer = next(c for c in _consumers(action) if c in ends)
            timed.append((ends[consumer] - _IDEAL_COST[consumer.type], send))
        for recv in _recvs_before(action, rank, placement):
            timed.append((ends[action] - _IDEAL_COST[action.type], recv))
    return timed


def _consumers(action: Action) -> list[Action]:
    """Candidate compute actions that consume what ``action`` sends (B or I for a backward)."""
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD:
        return [_f(s + 1, mb)]
    return [_b(s - 1, mb), Action(ActionType.BACKWARD_INPUT, s - 1, mb)]


def _recvs_before(action: Action, rank: int, placement: Placement) -> list[Action]:
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD and placement.is_remote(s - 1, rank):
        return [Action(ActionType.RECV_FORWARD, s, mb)]
    if action.type in INPUT_GRAD_TYPES and placement.is_remote(s + 1, rank):
        return [Action(ActionType.RECV_BACKWARD, s, mb)]
    return []


def _sends_after(action: Action, rank: int, placement: Placement) -> list[Action]:
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD and placement.is_remote(s + 1, rank):
        return [Action(ActionType.SEND_FORWARD, s, mb)]
    if action.type in INPUT_GRAD_TYPES and placement.is_remote(s - 1, rank):
        return [Action(ActionType.SEND_BACKWARD, s, mb)]
    return []


# ---------------------------------------------------------------------------
# Public generators


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe F-then-B: forwards mb 0..m-1, then backwards mb m-1..0 (v must be 1)."""
    _check_args("gpipe", p, m, v)
    return _attach_comm(_gpipe_order(p, m), placement_for("gpipe", p, v))


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): min(p-r-1, m) warm-up forwards, 1F1B, cool-down (v must be 1)."""
    _check_args("1f1b", p, m, v)
    return _attach_comm(_one_f_one_b_order(p, m), placement_for("1f1b", p, v))


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron interleaved 1F1B over v model chunks per rank (v >= 2, m % p == 0)."""
    _check_args("interleaved_1f1b", p, m, v)
    return _attach_comm(_interleaved_order(p, m, v), placement_for("interleaved_1f1b", p, v))


def zero_bubble(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 zero-bubble schedule with split backward (I then deferred W; v must be 1)."""
    _check_args("zero_bubble", p, m, v)
    return _attach_comm(_zero_bubble_order(p, m), placement_for("zero_bubble", p, v))


def zbv(p: int, m: int, v: int = 2) -> Schedule:
    """ZB-V: zero bubble over two stages per rank placed in a V (v must be 2; any m >= 1)."""
    _check_args("zbv", p, m, v)
    return _attach_comm(_zbv_order(p, m), placement_for("zbv", p, v))


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble": zero_bubble,
    "zbv": zbv,
}
# Schedules whose stages sit in a V (rank r: stages r and 2p-1-r); the rest interleave.
_V_PLACED = frozenset({"zbv"})


def placement_for(name: str, p: int, v: int = 1) -> Placement:
    """Where schedule ``name`` puts the p * v stages: the one home of the stage -> rank map.

    Raises:
        ParallelConfigError: unknown name.
        ValueError: p < 1 or v < 1.
    """
    if name not in SCHEDULES:
        raise ParallelConfigError(f"unknown pipeline schedule {name!r}; valid choices: {sorted(SCHEDULES)}")
    return Placement(p, v, v_shape=name in _V_PLACED)


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build the schedule registered as ``name`` for p ranks, m micro-batches, v stages per rank.

    Raises:
        ParallelConfigError: unknown name, or (p, m, v) the schedule does not support.
    """
    if name not in SCHEDULES:
        raise ParallelConfigError(f"unknown pipeline schedule {name!r}; valid choices: {sorted(SCHEDULES)}")
    return SCHEDULES[name](p, m, v)


def forward_only(placement: Placement, m: int) -> Schedule:
    """Evaluation: every rank runs, for each micro-batch in turn, the forwards of its stages.

    Rank r's list is ``for mb: for s in placement.stages_of(r): [RF s.mb] F s.mb [SF s.mb]``.
    Every rank posts its messages in increasing (micro-batch, receiving stage)
    order, one global order, so the batched comm cannot deadlock (the argument
    of `_attach_comm`). Works for any m and any placement (interleaved or V).
    """
    if m < 1:
        raise ValueError(f"forward_only needs m >= 1 micro-batches; got m={m}")
    schedule: Schedule = []
    for rank in range(placement.p):
        out: list[Action] = []
        for mb in range(m):
            for s in placement.stages_of(rank):
                if placement.is_remote(s - 1, rank):
                    out.append(Action(ActionType.RECV_FORWARD, s, mb))
                out.append(Action(ActionType.FORWARD, s, mb))
                if placement.is_remote(s + 1, rank):
                    out.append(Action(ActionType.SEND_FORWARD, s, mb))
        schedule.append(out)
    return schedule


def _check_args(name: str, p: int, m: int, v: int) -> None:
    if p < 1:
        raise ParallelConfigError(f"{name}: pipeline_parallel_size p={p} must be >= 1")
    if m < 1:
        raise ParallelConfigError(f"{name}: num_microbatches m={m} must be >= 1")
    if name == "interleaved_1f1b":
        if v < 2:
            raise ParallelConfigError(
                f"{name}: needs v >= 2 virtual stages per rank, got v={v}; use '1f1b' for v=1"
            )
        if m % p != 0:
            raise ParallelConfigError(
                f"{name}: num_microbatches m={m} must be a multiple of pipeline_parallel_size p={p} "
                f"(m % p = {m % p}); e.g. m={m + p - m % p}"
            )
    elif name == "zbv":
        if v != 2:
            raise ParallelConfigError(
                f"{name}: needs exactly v=2 stages per rank (the two arms of the V), got v={v}"
            )
    elif v != 1:
        raise ParallelConfigError(
            f"{name}: supports only v=1 virtual stage per rank, got v={v}; use 'interleaved_1f1b' or 'zbv'"
        )
