"""Pipeline schedules as data: generators, a validator and a pretty-printer.

This module owns *what* each pipeline rank does and in which order; it never
runs anything. A schedule is ``list[list[Action]]``: one ordered list per rank
(torchgpipe's ``clock_cycles``, PyTorch pipelining's ``2F0`` actions). The
executor (``parallel/executor.py``) and the simulator (``parallel/simulate.py``)
both walk these lists verbatim, so the order, the p2p pairing and the place of
the gradient reduce are decided here once and checked by ``validate_schedule``.
Pure Python: no torch.

Placement (Megatron interleaved): stage ``s`` lives on rank ``s % p``, so rank
``r`` holds stages ``r, r + p, r + 2p, ...``. With v == 1 this is stage == rank.

Comm convention. Every comm action names the stage *on the rank that runs it*::

    rank(s)                         rank(s + 1)
    F s.mb -> SF s.mb  ==========>  RF s+1.mb -> F s+1.mb        (activations)
    RB s.mb -> B s.mb  <==========  SB s+1.mb <- B s+1.mb        (input grads)

- ``SF s.mb`` sends stage s's output to stage s+1; it matches ``RF s+1.mb``.
- ``SB s.mb`` sends the grad of stage s's input to stage s-1; it matches
  ``RB s-1.mb``.
- A recv is emitted right before the compute that needs it, a send after the
  compute that produced it (see ``_attach_comm`` for exactly where); no comm is
  emitted between stages on the same rank (only when p == 1 with this placement).

Batched-comm (deadlock) semantics. The executor posts every *maximal run of
consecutive comm actions* of a rank as one ``batch_isend_irecv`` and waits for
all of it. A batch completes only once every op's peer op has been posted by the
peer (in the batch the peer is blocked on, or in one it already passed). The
generators keep every rank's comm ops in one global message order, which rules
out deadlock and gives Megatron's pairing in 1F1B (``F [SF RB] B [SB RF] F``).
NCCL p2p has no tags, so messages between a pair of ranks also match in posting
order. ``validate_schedule`` checks both properties on any schedule.

GRAD_REDUCE is the last action of every rank: the executor all-reduces the
data-parallel and tied-embedding gradients there, once every weight gradient of
the flush is final. Its stage and micro-batch are ``-1`` (it covers all the
rank's stages).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# p: pipeline ranks, m: micro-batches, v: virtual stages per rank, n: stages (n = p * v)


class ActionType(enum.Enum):
    """What a rank does at one slot of its schedule; the value is the short code."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input grad + weight grad
    BACKWARD_INPUT = "I"  # input grad only (zero-bubble "B")
    BACKWARD_WEIGHT = "W"  # weight grad only (zero-bubble "W")
    SEND_FORWARD = "SF"
    RECV_FORWARD = "RF"
    SEND_BACKWARD = "SB"
    RECV_BACKWARD = "RB"
    GRAD_REDUCE = "GR"

    @property
    def is_comm(self) -> bool:
        return self in _COMM_TYPES

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE_TYPES


_COMPUTE_TYPES = frozenset(
    {ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT}
)
_COMM_TYPES = frozenset(
    {ActionType.SEND_FORWARD, ActionType.RECV_FORWARD, ActionType.SEND_BACKWARD, ActionType.RECV_BACKWARD}
)
# Actions after which a stage's input gradient exists (what SB sends, what frees activations).
INPUT_GRAD_TYPES = frozenset({ActionType.BACKWARD, ActionType.BACKWARD_INPUT})
# Actions that produce weight gradients (GRAD_REDUCE must come after all of them).
WEIGHT_GRAD_TYPES = frozenset({ActionType.BACKWARD, ActionType.BACKWARD_WEIGHT})

_ACTION_RE = re.compile(r"^(SF|RF|SB|RB|F|B|I|W)(\d+)\.(\d+)$")


@dataclass(frozen=True)
class Action:
    """One slot of a rank's schedule: ``type`` on (``stage``, ``microbatch``).

    ``str(Action(FORWARD, 2, 3)) == "F2.3"``; ``Action.parse`` inverts it.
    GRAD_REDUCE prints as ``"GR"`` and carries stage = microbatch = -1.
    """

    type: ActionType
    stage: int
    microbatch: int

    def __str__(self) -> str:
        if self.type is ActionType.GRAD_REDUCE:
            return "GR"
        return f"{self.type.value}{self.stage}.{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @staticmethod
    def parse(text: str) -> Action:
        """Parse ``"F0.1"``, ``"SB3.0"``, ``"GR"``; raises ValueError on anything else."""
        text = text.strip()
        if text == "GR":
            return GRAD_REDUCE
        match = _ACTION_RE.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <type><stage>.<microbatch> with type in "
                f"{[t.value for t in ActionType if t is not ActionType.GRAD_REDUCE]}, or 'GR'"
            )
        return Action(ActionType(match.group(1)), int(match.group(2)), int(match.group(3)))


GRAD_REDUCE = Action(ActionType.GRAD_REDUCE, -1, -1)

Schedule = list[list[Action]]


# ---------------------------------------------------------------------------
# Placement


def stage_to_rank(stage: int, p: int) -> int:
    """Rank holding ``stage`` under interleaved placement (stage s on rank s % p)."""
    return stage % p


def rank_stages(rank: int, p: int, v: int) -> list[int]:
    """Stages held by ``rank``, in model order: ``[rank, rank + p, ..., rank + (v-1)p]``."""
    return [rank + chunk * p for chunk in range(v)]


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


def _attach_comm(order: Schedule, p: int, v: int) -> Schedule:
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
    n = p * v
    ends = _ideal_end_times(order, p, n)
    schedule: Schedule = []
    for rank, ops in enumerate(order):
        comm = sorted(_comm_ops(ops, rank, p, n, ends), key=lambda c: (c[0], _message(c[1])))
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


def _ideal_end_times(order: Schedule, p: int, n: int) -> dict[Action, float]:
    """End time of each compute action when comm is free and instantaneous.

    Raises:
        ScheduleError: if the compute orders wait on each other in a cycle.
    """
    present = {a for ops in order for a in ops}
    ends: dict[Action, float] = {}
    clock, pc = [0.0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(order):
            while pc[rank] < len(ops):
                action = ops[pc[rank]]
                deps = [d for d in _remote_inputs(action, rank, p, n) if d in present]
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


def _remote_inputs(action: Action, rank: int, p: int, n: int) -> list[Action]:
    """Compute actions on other ranks whose output ``action`` consumes (B or I for a backward)."""
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD and _remote(s - 1, rank, p, n):
        return [_f(s - 1, mb)]
    if action.type in INPUT_GRAD_TYPES and _remote(s + 1, rank, p, n):
        return [_b(s + 1, mb), Action(ActionType.BACKWARD_INPUT, s + 1, mb)]
    return []


def _comm_ops(
    ops: list[Action], rank: int, p: int, n: int, ends: dict[Action, float]
) -> list[tuple[float, Action]]:
    """(message time, op) for every send and recv of one rank; time = consumer's ideal start."""
    timed = []
    for action in ops:
        for send in _sends_after(action, rank, p, n):
            consumer = next(c for c in _consumers(action) if c in ends)
            timed.append((ends[consumer] - _IDEAL_COST[consumer.type], send))
        for recv in _recvs_before(action, rank, p, n):
            timed.append((ends[action] - _IDEAL_COST[action.type], recv))
    return timed


def _consumers(action: Action) -> list[Action]:
    """Candidate compute actions that consume what ``action`` sends (B or I for a backward)."""
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD:
        return [_f(s + 1, mb)]
    return [_b(s - 1, mb), Action(ActionType.BACKWARD_INPUT, s - 1, mb)]


def _remote(stage: int, rank: int, p: int, n: int) -> bool:
    """True if ``stage`` exists and lives on another rank than ``rank``."""
    return 0 <= stage < n and stage_to_rank(stage, p) != rank


def _recvs_before(action: Action, rank: int, p: int, n: int) -> list[Action]:
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD and _remote(s - 1, rank, p, n):
        return [Action(ActionType.RECV_FORWARD, s, mb)]
    if action.type in INPUT_GRAD_TYPES and _remote(s + 1, rank, p, n):
        return [Action(ActionType.RECV_BACKWARD, s, mb)]
    return []


def _sends_after(action: Action, rank: int, p: int, n: int) -> list[Action]:
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD and _remote(s + 1, rank, p, n):
        return [Action(ActionType.SEND_FORWARD, s, mb)]
    if action.type in INPUT_GRAD_TYPES and _remote(s - 1, rank, p, n):
        return [Action(ActionType.SEND_BACKWARD, s, mb)]
    return []


# ---------------------------------------------------------------------------
# Public generators


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe F-then-B: forwards mb 0..m-1, then backwards mb m-1..0 (v must be 1)."""
    _check_args("gpipe", p, m, v)
    return _attach_comm(_gpipe_order(p, m), p, v)


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): min(p-r-1, m) warm-up forwards, 1F1B, cool-down (v must be 1)."""
    _check_args("1f1b", p, m, v)
    return _attach_comm(_one_f_one_b_order(p, m), p, v)


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron interleaved 1F1B over v model chunks per rank (v >= 2, m % p == 0)."""
    _check_args("interleaved_1f1b", p, m, v)
    return _attach_comm(_interleaved_order(p, m, v), p, v)


def zero_bubble(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 zero-bubble schedule with split backward (I then deferred W; v must be 1)."""
    _check_args("zero_bubble", p, m, v)
    return _attach_comm(_zero_bubble_order(p, m), p, v)


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble": zero_bubble,
}


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build the schedule registered as ``name`` for p ranks, m micro-batches, v stages per rank.

    Raises:
        ValueError: unknown name, or (p, m, v) the schedule does not support.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid choices: {sorted(SCHEDULES)}")
    return SCHEDULES[name](p, m, v)


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Evaluation: every rank runs, for each micro-batch in turn, the forwards of its stages.

    Rank r's list is ``for mb: for s in rank_stages(r): [RF s.mb] F s.mb [SF s.mb]``.
    Every rank posts its messages in increasing (micro-batch, receiving stage)
    order, one global order, so the batched comm cannot deadlock (the argument
    of `_attach_comm`). Works for any m, also with interleaved placement (v > 1).
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"forward_only needs p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")
    n = p * v
    schedule: Schedule = []
    for rank in range(p):
        out: list[Action] = []
        for mb in range(m):
            for s in rank_stages(rank, p, v):
                if s > 0 and stage_to_rank(s - 1, p) != rank:
                    out.append(Action(ActionType.RECV_FORWARD, s, mb))
                out.append(Action(ActionType.FORWARD, s, mb))
                if s < n - 1 and stage_to_rank(s + 1, p) != rank:
                    out.append(Action(ActionType.SEND_FORWARD, s, mb))
        schedule.append(out)
    return schedule


def _check_args(name: str, p: int, m: int, v: int) -> None:
    if p < 1:
        raise ValueError(f"{name}: pipeline_parallel_size p={p} must be >= 1")
    if m < 1:
        raise ValueError(f"{name}: num_microbatches m={m} must be >= 1")
    if name == "interleaved_1f1b":
        if v < 2:
            raise ValueError(f"{name}: needs v >= 2 virtual stages per rank, got v={v}; use '1f1b' for v=1")
        if m % p != 0:
            raise ValueError(
                f"{name}: num_microbatches m={m} must be a multiple of pipeline_parallel_size p={p} "
                f"(m % p = {m % p}); e.g. m={m + p - m % p}"
            )
    elif v != 1:
        raise ValueError(
            f"{name}: supports only v=1 virtual stage per rank, got v={v}; use 'interleaved_1f1b'"
        )


# ---------------------------------------------------------------------------
# Validation


class ScheduleError(ValueError):
    """A schedule is incomplete, out of dependency order, mismatched or deadlocks."""


@dataclass(frozen=True)
class ScheduleStats:
    """What ``validate_schedule`` measured on a valid schedule.

    peak_in_flight[r]: most micro-batch activations rank r holds at once (forward
        done, input grad not yet done), summed over its stages.
    action_counts[r]: number of actions of each type in rank r's list.
    comm_batches[r]: number of comm batches (runs of consecutive comm actions).
    """

    peak_in_flight: list[int]
    action_counts: list[dict[ActionType, int]]
    comm_batches: list[int]


def validate_schedule(schedule: Sequence[Sequence[Action]], p: int, m: int, v: int = 1) -> ScheduleStats:
    """Check that ``schedule`` is complete, ordered, matched and deadlock-free.

    Returns:
        ScheduleStats of the schedule.

    Raises:
        ScheduleError: with the offending action(s), rank(s) and position(s).
    """
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")
    if len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists but p={p}")
    n = p * v
    positions = _index_actions(schedule, p, m, n)
    _check_complete(positions, n, m)
    _check_grad_reduce(schedule)
    _check_dependencies(schedule, positions, p, n)
    _check_matching(schedule, p)
    _check_deadlock(schedule, p)
    _check_pair_order(schedule, p)
    return _stats(schedule)


def _index_actions(
    schedule: Sequence[Sequence[Action]], p: int, m: int, n: int
) -> dict[Action, tuple[int, int]]:
    """Map each action to (rank, position); reject out-of-range, misplaced and duplicate actions."""
    positions: dict[Action, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule):
        for pos, action in enumerate(actions):
            if action.type is ActionType.GRAD_REDUCE:
                continue
            if not (0 <= action.stage < n and 0 <= action.microbatch < m):
                raise ScheduleError(
                    f"{action} on rank {rank} at position {pos}: stage must be in [0, {n}) "
                    f"and microbatch in [0, {m})"
                )
            if stage_to_rank(action.stage, p) != rank:
                raise ScheduleError(
                    f"{action} runs on rank {rank} at position {pos}, but stage {action.stage} "
                    f"lives on rank {stage_to_rank(action.stage, p)}"
                )
            if action in positions:
                raise ScheduleError(
                    f"duplicate action {action} on rank {rank} (positions {positions[action][1]} and {pos})"
                )
            positions[action] = (rank, pos)
    return positions


def _check_complete(positions: dict[Action, tuple[int, int]], n: int, m: int) -> None:
    """Every (stage, mb) needs F and either B, or I and W (never both kinds)."""
    for s in range(n):
        for mb in range(m):
            present = {t for t in _COMPUTE_TYPES if Action(t, s, mb) in positions}
            where = f"stage {s} micro-batch {mb}"
            if ActionType.FORWARD not in present:
                raise ScheduleError(f"missing action {_f(s, mb)} ({where} is never run forward)")
            split = {ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT} & present
            if ActionType.BACKWARD in present and split:
                raise ScheduleError(f"{where} has both a full backward B and a split backward I/W")
            if ActionType.BACKWARD not in present and len(split) != 2:
                missing = _b(s, mb) if not split else Action(_other_half(split), s, mb)
                raise ScheduleError(f"missing action {missing} ({where} has no complete backward)")


def _other_half(split: set[ActionType]) -> ActionType:
    if ActionType.BACKWARD_INPUT in split:
        return ActionType.BACKWARD_WEIGHT
    return ActionType.BACKWARD_INPUT


def _check_grad_reduce(schedule: Sequence[Sequence[Action]]) -> None:
    for rank, actions in enumerate(schedule):
        spots = [pos for pos, a in enumerate(actions) if a.type is ActionType.GRAD_REDUCE]
        if len(spots) != 1:
            raise ScheduleError(
                f"rank {rank} has {len(spots)} GRAD_REDUCE actions (positions {spots}); need 1"
            )
        last_weight = max((pos for pos, a in enumerate(actions) if a.type in WEIGHT_GRAD_TYPES), default=-1)
        if spots[0] < last_weight:
            raise ScheduleError(
                f"GRAD_REDUCE on rank {rank} at position {spots[0]} comes before "
                f"{actions[last_weight]} at position {last_weight}: gradients are not final yet"
            )
        if spots[0] != len(actions) - 1:
            raise ScheduleError(
                f"GRAD_REDUCE on rank {rank} at position {spots[0]} must be the rank's last action "
                f"(found {actions[-1]} after it)"
            )


def _prerequisites(action: Action, p: int, n: int) -> list[list[Action]]:
    """Actions that must precede ``action`` on its own rank (each inner list: any one of them).

    Cross-rank dependencies are carried by a recv (and the peer's send by the
    compute that produced it), so given matching and deadlock freedom, local order
    implies the global data dependencies.
    """
    t, s, mb = action.type, action.stage, action.microbatch
    rank = stage_to_rank(s, p)
    grads = [ActionType.BACKWARD, ActionType.BACKWARD_INPUT]
    if t is ActionType.FORWARD and s > 0:
        return [[Action(ActionType.RECV_FORWARD, s, mb)]] if _remote(s - 1, rank, p, n) else [[_f(s - 1, mb)]]
    if t in INPUT_GRAD_TYPES:
        if s == n - 1:
            return [[_f(s, mb)]]
        if _remote(s + 1, rank, p, n):
            return [[_f(s, mb)], [Action(ActionType.RECV_BACKWARD, s, mb)]]
        return [[_f(s, mb)], [Action(g, s + 1, mb) for g in grads]]
    if t is ActionType.BACKWARD_WEIGHT:
        return [[Action(ActionType.BACKWARD_INPUT, s, mb)]]
    if t is ActionType.SEND_FORWARD:
        return [[_f(s, mb)]]
    if t is ActionType.SEND_BACKWARD:
        return [[Action(g, s, mb) for g in grads]]
    return []


def _check_dependencies(
    schedule: Sequence[Sequence[Action]], positions: dict[Action, tuple[int, int]], p: int, n: int
) -> None:
    for rank, actions in enumerate(schedule):
        for pos, action in enumerate(actions):
            if action.type is ActionType.GRAD_REDUCE:
                continue
            _check_comm_is_needed(action, rank, p, n)
            for options in _prerequisites(action, p, n):
                found = [positions[o][1] for o in options if o in positions]
                if not found:
                    raise ScheduleError(
                        f"{action} on rank {rank} at position {pos} needs {options[0]} before it, "
                        f"but the schedule has no {options[0]}"
                    )
                if min(found) > pos:
                    before = actions[min(found)]
                    raise ScheduleError(
                        f"dependency violated on rank {rank}: {action} at position {pos} runs before "
                        f"{before} at position {min(found)}, which it needs"
                    )


def _check_comm_is_needed(action: Action, rank: int, p: int, n: int) -> None:
    """Reject comm actions towards a stage that does not exist or is on the same rank."""
    peer_stage = {
        ActionType.SEND_FORWARD: action.stage + 1,
        ActionType.RECV_FORWARD: action.stage - 1,
        ActionType.SEND_BACKWARD: action.stage - 1,
        ActionType.RECV_BACKWARD: action.stage + 1,
    }.get(action.type)
    if peer_stage is not None and not _remote(peer_stage, rank, p, n):
        raise ScheduleError(
            f"{action} on rank {rank}: stage {peer_stage} is not a stage on another rank, nothing to exchange"
        )


# A message is identified by (direction, sending stage, micro-batch); both its
# send and its recv map to the same key.
_Message = tuple[str, int, int]


def _message(action: Action) -> _Message:
    t, s, mb = action.type, action.stage, action.microbatch
    if t is ActionType.SEND_FORWARD:
        return ("F", s, mb)
    if t is ActionType.RECV_FORWARD:
        return ("F", s - 1, mb)
    if t is ActionType.SEND_BACKWARD:
        return ("B", s, mb)
    return ("B", s + 1, mb)  # RECV_BACKWARD


def peer_action(action: Action) -> Action:
    """The matching op of a comm action (the recv of a send, the send of a recv)."""
    t, s, mb = action.type, action.stage, action.microbatch
    peer = {
        ActionType.SEND_FORWARD: (ActionType.RECV_FORWARD, s + 1),
        ActionType.RECV_FORWARD: (ActionType.SEND_FORWARD, s - 1),
        ActionType.SEND_BACKWARD: (ActionType.RECV_BACKWARD, s - 1),
        ActionType.RECV_BACKWARD: (ActionType.SEND_BACKWARD, s + 1),
    }[t]
    return Action(peer[0], peer[1], mb)


def is_send(action: Action) -> bool:
    return action.type in (ActionType.SEND_FORWARD, ActionType.SEND_BACKWARD)


def _check_matching(schedule: Sequence[Sequence[Action]], p: int) -> None:
    """Every send has its recv and vice versa."""
    present = {a for actions in schedule for a in actions if a.type.is_comm}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.type.is_comm and peer_action(a) not in present:
                kind = "send" if is_send(a) else "recv"
                raise ScheduleError(
                    f"{kind} {a} on rank {rank} has no matching {peer_action(a)} on rank "
                    f"{stage_to_rank(peer_action(a).stage, p)}"
                )


def _check_pair_order(schedule: Sequence[Sequence[Action]], p: int) -> None:
    """NCCL p2p ignores tags: the k-th send from rank a to rank b meets the k-th recv
    posted on b from a, so both sides must list the messages in one order. (Given
    deadlock freedom only a reordering inside one batch can break this.)
    """
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.type.is_comm:
                other = stage_to_rank(peer_action(a).stage, p)
                if is_send(a):
                    sent.setdefault((rank, other), []).append(a)
                else:
                    received.setdefault((other, rank), []).append(a)
    for (src, dst), sends in sorted(sent.items()):
        for k, (snd, rcv) in enumerate(zip(sends, received[(src, dst)])):
            if _message(snd) != _message(rcv):
                raise ScheduleError(
                    f"p2p order mismatch from rank {src} to rank {dst}: message #{k} is {snd} on "
                    f"rank {src} but {rcv} on rank {dst} (p2p matches in posting order)"
                )


def comm_batches(actions: Sequence[Action]) -> list[tuple[int, int]]:
    """[start, end) index ranges of the maximal runs of consecutive comm actions."""
    batches: list[tuple[int, int]] = []
    pos = 0
    while pos < len(actions):
        if actions[pos].type.is_comm:
            end = pos
            while end < len(actions) and actions[end].type.is_comm:
                end += 1
            batches.append((pos, end))
            pos = end
        else:
            pos += 1
    return batches


def _check_deadlock(schedule: Sequence[Sequence[Action]], p: int) -> None:
    """Run every rank under the batched-comm semantics until all finish or none can move.

    A rank runs computes freely; at a comm batch it posts all the batch's ops and
    blocks until each op's peer op is posted too. Posted ops stay posted, so
    "posted" covers both the peer's current batch and the ones it already passed.
    """
    batch_end = [{start: end for start, end in comm_batches(actions)} for actions in schedule]
    pc = [0] * p
    posted: set[Action] = set()
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule):
            while pc[rank] < len(actions):
                end = batch_end[rank].get(pc[rank])
                if end is None:
                    pc[rank] += 1
                else:
                    batch = actions[pc[rank] : end]
                    posted.update(batch)
                    if any(peer_action(a) not in posted for a in batch):
                        break
                    pc[rank] = end
                progress = True
    if any(pc[r] < len(schedule[r]) for r in range(p)):
        raise ScheduleError("deadlock under batched p2p: " + _describe_blocked(schedule, pc, posted, p))


def _describe_blocked(
    schedule: Sequence[Sequence[Action]], pc: list[int], posted: set[Action], p: int
) -> str:
    parts = []
    for rank, actions in enumerate(schedule):
        if pc[rank] >= len(actions):
            continue
        end = dict(comm_batches(actions))[pc[rank]]
        batch = actions[pc[rank] : end]
        waits = [
            f"{peer_action(a)} on rank {stage_to_rank(peer_action(a).stage, p)}"
            for a in batch
            if peer_action(a) not in posted
        ]
        parts.append(
            f"rank {rank} blocked at position {pc[rank]} on [{' '.join(map(str, batch))}] "
            f"waiting for {', '.join(waits)}"
        )
    return "; ".join(parts)


def _stats(schedule: Sequence[Sequence[Action]]) -> ScheduleStats:
    peaks, counts, batches = [], [], []
    for actions in schedule:
        held = peak = 0
        count: dict[ActionType, int] = {}
        for a in actions:
            count[a.type] = count.get(a.type, 0) + 1
            if a.type is ActionType.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.type in INPUT_GRAD_TYPES:
                held -= 1
        peaks.append(peak)
        counts.append(count)
        batches.append(len(comm_batches(actions)))
    return ScheduleStats(peak_in_flight=peaks, action_counts=counts, comm_batches=batches)


# ---------------------------------------------------------------------------
# Display


def compute_order(actions: Sequence[Action]) -> str:
    """The compute actions of one rank as ``"F0.0 F0.1 B0.0 ..."`` (golden-table format)."""
    return " ".join(str(a) for a in actions if a.type.is_compute)


def format_schedule(schedule: Sequence[Sequence[Action]], comm: bool = False) -> str:
    """One line per rank. Compute actions only, or with ``comm=True`` every action
    with each comm batch in brackets, e.g. ``F0.0 [SF0.0 RB0.0] B0.0``.
    """
    lines = []
    for rank, actions in enumerate(schedule):
        if comm:
            cells = _cells_with_batches(actions)
        else:
            cells = [str(a) for a in actions if a.type.is_compute]
        lines.append(f"rank {rank}: " + " ".join(f"{c:<5}" for c in cells).rstrip())
    return "\n".join(lines)


def _cells_with_batches(actions: Sequence[Action]) -> list[str]:
    starts = dict(comm_batches(actions))
    cells, pos = [], 0
    while pos < len(actions):
        if pos in starts:
            cells.append("[" + " ".join(map(str, actions[pos : starts[pos]])) + "]")
            pos = starts[pos]
        else:
            cells.append(str(actions[pos]))
            pos += 1
    return cells
