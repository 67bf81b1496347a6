"""The vocabulary schedules are written in: actions, messages, and where stages live.

This module owns the data types every pipeline module shares: an ``Action``
(forward, backward, split backward, send, recv, reduce on (stage, micro-batch)),
a ``Schedule`` (one ordered action list per rank), the ``message`` key that pairs
a send with its recv, and the ``Placement`` that says which pipeline rank holds
which stage. ``parallel/pipeline/schedule.py`` generates schedules in it (and re-exports
these names), ``parallel/pipeline/validate.py`` checks them, ``parallel/pipeline/simulate.py`` times
them and ``parallel/pipeline/executor.py`` runs them. Pure Python: no torch.
"""

from __future__ import annotations

import enum
import re
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

    Raised by ``parallel.pipeline.validate``, the simulator and ``parallel.pipeline.schedule`` (a
    compute order that cannot make progress); defined here, beside the
    vocabulary, so the dependencies between those modules point one way.
    """


# ---------------------------------------------------------------------------
# Placement: which rank holds which stage


@dataclass(frozen=True)
class Placement:
    """Which pipeline rank holds which of the n = p * v stages; one per schedule.

    Interleaved (Megatron, every schedule but ZB-V): rank r holds r, r + p, r + 2p, ...;
    with v == 1 stage == rank. V-shaped (ZB-V; Qi et al. 2024, "Zero Bubble Pipeline
    Parallelism", sec 6, and their "Pipeline Parallelism with Controllable Memory"):
    odd chunks run back up the ranks, so with v = 2 rank r holds stages r and 2p - 1 - r::

        stage           0 1 2 3 4 5 6 7        (p = 4, v = 2)
        interleaved     0 1 2 3 0 1 2 3
        V               0 1 2 3 3 2 1 0

    Under V the turn (stages p - 1 and p) is on one rank, so nothing crosses a link
    there, and the first and the last stage (both holding the tied embedding of an
    encoder-decoder) share rank 0. The schedule's name picks it
    (``parallel.pipeline.schedule.placement_for``); the executor, the partition, p2p peers,
    the tied-embedding group and the logging rank all read it from there.
    """

    p: int
    v: int = 1
    v_shape: bool = False

    def __post_init__(self) -> None:
        if self.p < 1 or self.v < 1:
            raise ValueError(
                f"a placement needs p >= 1 ranks and v >= 1 stages per rank; got p={self.p}, v={self.v}"
            )

    @property
    def n(self) -> int:
        """Number of stages."""
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        """Pipeline rank holding ``stage``."""
        chunk, pos = divmod(stage, self.p)
        return self.p - 1 - pos if self.v_shape and chunk % 2 else pos

    def stages_of(self, rank: int) -> list[int]:
        """Stages held by ``rank``, in model order (interleaved: ``[rank, rank + p, ...]``)."""
        return [s for s in range(self.n) if self.rank_of(s) == rank]

    def is_remote(self, stage: int, rank: int) -> bool:
        """True if ``stage`` exists (0 <= stage < n) and lives on another rank than ``rank``."""
        return 0 <= stage < self.n and self.rank_of(stage) != rank


# ---------------------------------------------------------------------------
# Messages


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
