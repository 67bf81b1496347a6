"""Pure pipeline simulator: predicted makespan, bubble and activation memory of a schedule.

This module owns the *prediction* side of pipeline performance. It walks the
same per-rank action lists the executor runs (``parallel/pipeline/schedule.py``), with
per-stage costs (measured or assumed) instead of real work, so a schedule's
bubble and memory can be compared with the theory and with measured runs. The
walk itself is ``parallel.pipeline.validate.walk_ranks``, the one the deadlock check
uses; this module adds only clocks and when a batch completes.
Pure Python: no torch.

Timing model:
- each rank runs its list in order; a compute action takes its stage's cost
  (BACKWARD = backward_input + backward_weight);
- a maximal run of consecutive comm actions is one batch, as in the executor;
  the rank waits until every op of the batch completes;
- a message's data arrives ``link`` after its send is posted and a recv
  completes when its data has arrived; sends are buffered and complete when
  posted (the default). With ``rendezvous=True`` (NCCL/gloo-like for large
  tensors) a transfer starts only once both sides have posted, and both ops
  complete ``link`` after that;
- GRAD_REDUCE takes no time (the data-parallel reduce is outside the pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from parallel.pipeline.schedule import INPUT_GRAD_TYPES, Action, ActionType, ScheduleError
from parallel.pipeline.validate import is_send, peer_action, walk_ranks

# p: pipeline ranks, m: micro-batches, v: virtual stages per rank, n: stages (n = p * v)


@dataclass(frozen=True)
class StageCosts:
    """Per-stage costs of one micro-batch (any time unit; bytes for activations).

    forward[s], backward_input[s], backward_weight[s]: compute time of stage s.
    link: time of one p2p transfer.
    activation_bytes[s]: memory a micro-batch's activations hold on stage s from
        its forward until its input grad; None counts 1 per micro-batch.
    """

    forward: Sequence[float]
    backward_input: Sequence[float]
    backward_weight: Sequence[float]
    link: float = 0.0
    activation_bytes: Sequence[float] | None = None

    @staticmethod
    def uniform(
        n: int,
        forward: float = 1.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
        link: float = 0.0,
    ) -> StageCosts:
        """The same costs on each of the n stages."""
        return StageCosts([forward] * n, [backward_input] * n, [backward_weight] * n, link)

    def compute_time(self, action: Action) -> float:
        s = action.stage
        if action.type is ActionType.FORWARD:
            return self.forward[s]
        if action.type is ActionType.BACKWARD:
            return self.backward_input[s] + self.backward_weight[s]
        if action.type is ActionType.BACKWARD_INPUT:
            return self.backward_input[s]
        if action.type is ActionType.BACKWARD_WEIGHT:
            return self.backward_weight[s]
        return 0.0


class TimelineEvent(NamedTuple):
    """One action as simulated: comm ops span from posting to completion."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Outcome of ``simulate``.

    bubble_fraction = sum(idle) / (p * makespan), where idle[r] = makespan - busy[r]
    and busy[r] is rank r's compute time (comm waits count as idle).
    """

    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_fraction: float
    peak_activation_bytes: list[float]
    timeline: list[TimelineEvent]


def bubble_theory(p: int, m: int, v: int = 1, schedule: str | None = None) -> float:
    """Idle share of a pipeline flush with balanced stages and free comm.

    GPipe and 1F1B: (p - 1) / (m + p - 1): each rank idles (p - 1) stage-times of
    forward + backward while filling and draining the pipe, out of m + p - 1.
    Interleaved 1F1B with v chunks per rank shrinks the fill/drain by v
    (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", sec 2.2.2: bubble/ideal = (p - 1) / (v m)),
    so the idle share is (p - 1) / (v m + p - 1). ZB-H1 does better than this bound.

    ``schedule="zbv"`` (ZB-V with F = I = W, in stage-times; each of a rank's two
    chunks is half a stage): a rank's work is 3m, and each rank idles
    e = max((p - 1) / 2, 2p - 1 - m). The first term is the V's fill, rank p-1
    waiting for p-1 half-stage forwards; no order does better, since stage p-1
    cannot start earlier. The second is the empty slots of the order built for
    2p - 1 micro-batches when m is smaller (`parallel.pipeline.schedule._zbv_order`).
    Share e / (3m + e): (p - 1) / (6m + p - 1) for m >= 2p - 1, half of ZB-H1's
    (p - 1) / (3m + p - 1). `tests/unit/test_simulate.py` checks it against the
    simulator.
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")
    if schedule == "zbv":
        idle = max((p - 1) / 2, 2 * p - 1 - m)
        return idle / (3 * m + idle)
    return (p - 1) / (v * m + p - 1)


def simulate(
    schedule: Sequence[Sequence[Action]],
    p: int,
    m: int,
    v: int,
    costs: StageCosts,
    rendezvous: bool = False,
) -> SimResult:
    """Simulate ``schedule`` with ``costs``; see the module docstring for the model.

    Raises:
        ValueError: cost lists do not have one entry per stage (n = p * v).
        ScheduleError: the schedule deadlocks.
    """
    _check_costs(costs, p * v)
    if len(schedule) != p:
        raise ValueError(f"schedule has {len(schedule)} rank lists but p={p}")
    timeline = _run(schedule, costs, rendezvous)
    makespan = max((e.end for e in timeline), default=0.0)
    busy = [0.0] * p
    for event in timeline:
        if event.action.type.is_compute:
            busy[event.rank] += event.end - event.start
    idle = [makespan - b for b in busy]
    bubble = sum(idle) / (p * makespan) if makespan > 0 else 0.0
    peaks = [_peak_activations(actions, costs) for actions in schedule]
    return SimResult(makespan, busy, idle, bubble, peaks, sorted(timeline, key=lambda e: (e.start, e.rank)))


def _check_costs(costs: StageCosts, n: int) -> None:
    lists = {
        "forward": costs.forward,
        "backward_input": costs.backward_input,
        "backward_weight": costs.backward_weight,
    }
    if costs.activation_bytes is not None:
        lists["activation_bytes"] = costs.activation_bytes
    for name, values in lists.items():
        if len(values) != n:
            raise ValueError(f"StageCosts.{name} has {len(values)} entries but there are n={n} stages")


def _run(schedule: Sequence[Sequence[Action]], costs: StageCosts, rendezvous: bool) -> list[TimelineEvent]:
    """Advance every rank as far as the posted peer ops allow (`walk_ranks`), until all finish."""
    clock = [0.0] * len(schedule)
    posted: dict[Action, float] = {}  # comm op -> time its rank posted it
    timeline: list[TimelineEvent] = []

    def compute(rank: int, action: Action) -> None:
        finish = clock[rank] + costs.compute_time(action)
        timeline.append(TimelineEvent(rank, action, clock[rank], finish))
        clock[rank] = finish

    def try_batch(rank: int, batch: Sequence[Action]) -> bool:
        for op in batch:
            posted.setdefault(op, clock[rank])
        done = _batch_done(batch, posted, costs.link, rendezvous)
        if done is None:
            return False
        timeline.extend(TimelineEvent(rank, op, posted[op], done) for op in batch)
        clock[rank] = done
        return True

    pc = walk_ranks(schedule, compute, try_batch)
    stuck = [f"rank {r} at {actions[pc[r]]}" for r, actions in enumerate(schedule) if pc[r] < len(actions)]
    if stuck:
        raise ScheduleError(f"schedule deadlocks in simulation: {', '.join(stuck)}")
    return timeline


def _batch_done(
    batch: Sequence[Action], posted: dict[Action, float], link: float, rendezvous: bool
) -> float | None:
    """Completion time of a posted batch, or None while a needed peer op is not posted."""
    done = 0.0
    for op in batch:
        peer = peer_action(op)
        if not rendezvous and is_send(op):
            done = max(done, posted[op])  # buffered send: done once handed over
        elif peer not in posted:
            return None
        elif rendezvous:
            done = max(done, max(posted[op], posted[peer]) + link)
        else:
            done = max(done, posted[op], posted[peer] + link)  # recv: when the data lands
    return done


def _peak_activations(actions: Sequence[Action], costs: StageCosts) -> float:
    """Largest activation memory held at once: from F until I (or B) of a micro-batch."""
    held = peak = 0.0
    for a in actions:
        size = 1.0 if costs.activation_bytes is None else costs.activation_bytes[a.stage]
        if a.type is ActionType.FORWARD:
            held += size
            peak = max(peak, held)
        elif a.type in INPUT_GRAD_TYPES:
            held -= size
    return peak
