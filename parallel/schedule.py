"""Pipeline schedules as data: the action vocabulary and the generators.

This module owns *what* each pipeline rank does and in which order; it never
runs anything. A schedule is ``list[list[Action]]``: one ordered list per rank
(torchgpipe's ``clock_cycles``, PyTorch pipelining's ``2F0`` actions). The
executor (``parallel/executor.py``) and the simulator (``parallel/simulate.py``)
both walk these lists verbatim, so the order, the p2p pairing and the place of
the gradient reduce are decided here once. Pure Python: no torch.

Placement (Megatron interleaved): stage ``s`` lives on rank ``s % p``, so rank
``r`` holds stages ``r, r + p, r + 2p, ...``. With v == 1 this is stage == rank.

Comm: ``SF s.mb`` sends stage s's output to ``RF s+1.mb``, ``SB s.mb`` sends the
grad of stage s's input to ``RB s-1.mb``; each maximal run of consecutive comm
actions is posted as one batch. ``parallel/validate.py`` states this convention
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

import enum
import re
from collections.abc import Callable
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


class ScheduleError(ValueError):
    """A schedule is incomplete, out of dependency order, mismatched or deadlocks.

    Raised by ``parallel.validate`` and the simulator, and here by `_ideal_end_times`
    (a compute order that cannot make progress); defined here so the dependency
    between the two modules points one way (validate imports schedule).
    """


# ---------------------------------------------------------------------------
# Placement and messages


def stage_to_rank(stage: int, p: int) -> int:
    """Rank holding ``stage`` under interleaved placement (stage s on rank s % p)."""
    return stage % p


def rank_stages(rank: int, p: int, v: int) -> list[int]:
    """Stages held by ``rank``, in model order: ``[rank, rank + p, ..., rank + (v-1)p]``."""
    return [rank + chunk * p for chunk in range(v)]


def is_remote(stage: int, rank: int, p: int, n: int) -> bool:
    """True if ``stage`` exists (0 <= stage < n) and lives on another rank than ``rank``."""
    return 0 <= stage < n and stage_to_rank(stage, p) != rank


# A message is identified by (direction, sending stage, micro-batch); both its
# send and its recv map to the same key.
Message = tuple[str, int, int]


def message(action: Action) -> Message:
    """The message a comm action sends or receives, the same key on both sides."""
    t, s, mb = action.type, action.stage, action.microbatch
    if t is ActionType.SEND_FORWARD:
        return ("F", s, mb)
    if t is ActionType.RECV_FORWARD:
        return ("F", s - 1, mb)
    if t is ActionType.SEND_BACKWARD:
        return ("B", s, mb)
    return ("B", s + 1, mb)  # RECV_BACKWARD


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
        comm = sorted(_comm_ops(ops, rank, p, n, ends), key=lambda c: (c[0], message(c[1])))
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
    if action.type is ActionType.FORWARD and is_remote(s - 1, rank, p, n):
        return [_f(s - 1, mb)]
    if action.type in INPUT_GRAD_TYPES and is_remote(s + 1, rank, p, n):
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


def _recvs_before(action: Action, rank: int, p: int, n: int) -> list[Action]:
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD and is_remote(s - 1, rank, p, n):
        return [Action(ActionType.RECV_FORWARD, s, mb)]
    if action.type in INPUT_GRAD_TYPES and is_remote(s + 1, rank, p, n):
        return [Action(ActionType.RECV_BACKWARD, s, mb)]
    return []


def _sends_after(action: Action, rank: int, p: int, n: int) -> list[Action]:
    s, mb = action.stage, action.microbatch
    if action.type is ActionType.FORWARD and is_remote(s + 1, rank, p, n):
        return [Action(ActionType.SEND_FORWARD, s, mb)]
    if action.type in INPUT_GRAD_TYPES and is_remote(s - 1, rank, p, n):
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
