"""Whether a pipeline schedule can run: the comm semantics, the validator, a printer.

This module owns the rules a schedule (``parallel/pipeline/schedule.py``) must obey to run
on the executor, and the one loop that walks all ranks under the executor's
batched p2p, `walk_ranks`: the deadlock check here and the simulator
(``parallel/pipeline/simulate.py``) both drive it, so the semantics live in one place.
``validate_schedule`` checks that a schedule is complete, in dependency order,
matched and deadlock-free; ``format_schedule`` prints one with its comm batches.
Pure Python: no torch.

Comm convention. Every comm action names the stage *on the rank that runs it*::

    rank(s)                         rank(s + 1)
    F s.mb -> SF s.mb  ==========>  RF s+1.mb -> F s+1.mb        (activations)
    RB s.mb -> B s.mb  <==========  SB s+1.mb <- B s+1.mb        (input grads)

- ``SF s.mb`` sends stage s's output to stage s+1; it matches ``RF s+1.mb``.
- ``SB s.mb`` sends the grad of stage s's input to stage s-1; it matches
  ``RB s-1.mb``.
- A recv comes before the compute that needs it, a send after the compute that
  produced it (``parallel.pipeline.schedule._attach_comm`` decides exactly where); there
  is no comm between stages on the same rank (p == 1, or the turn of ZB-V's V,
  stages p-1 and p). Which rank holds a stage is the schedule's ``Placement``.

Batched-comm (deadlock) semantics. The executor posts every *maximal run of
consecutive comm actions* of a rank as one ``batch_isend_irecv`` and waits for
all of it. A batch completes only once every op's peer op has been posted by the
peer (in the batch the peer is blocked on, or in one it already passed). The
generators keep every rank's comm ops in one global message order, which rules
out deadlock and gives Megatron's pairing in 1F1B (``F [SF RB] B [SB RF] F``).
NCCL p2p has no tags, so messages between a pair of ranks also match in posting
order. ``validate_schedule`` checks both properties on any schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parallel.pipeline.actions import (
    INPUT_GRAD_TYPES,
    WEIGHT_GRAD_TYPES,
    Action,
    ActionType,
    Placement,
    ScheduleError,
    message,
)

# p: pipeline ranks, m: micro-batches, v: virtual stages per rank, n: stages (n = p * v)


# ---------------------------------------------------------------------------
# Batched p2p: the peer of an op, the batches of a rank, the walk over all ranks


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
    """True for SF and SB."""
    return action.type in (ActionType.SEND_FORWARD, ActionType.SEND_BACKWARD)


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


OnCompute = Callable[[int, Action], None]  # (rank, non-comm action)
TryBatch = Callable[[int, Sequence[Action]], bool]  # (rank, comm batch) -> batch completed


def walk_ranks(schedule: Sequence[Sequence[Action]], on_compute: OnCompute, try_batch: TryBatch) -> list[int]:
    """Advance every rank under the batched-comm semantics until all finish or none can move.

    Sweeps the ranks in order, each as far as it goes. A non-comm action (GRAD_REDUCE
    included) runs at once: ``on_compute(rank, action)``. At a comm batch the rank
    posts the batch and passes it only if ``try_batch(rank, batch)`` returns True;
    otherwise it stays blocked there and the same batch is tried again on the next
    sweep, so ``try_batch`` must post idempotently. The caller's ``try_batch`` owns
    the completion rule (the deadlock check: every peer op posted; the simulator:
    its timing model). Posted ops stay posted, so "posted" covers both the peer's
    current batch and the ones it already passed.

    Returns:
        Where each rank stopped: ``len(schedule[r])`` if rank r finished, else the
        start of the batch it is blocked on.
    """
    batch_end = [dict(comm_batches(actions)) for actions in schedule]
    pc = [0] * len(schedule)
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule):
            while pc[rank] < len(actions):
                end = batch_end[rank].get(pc[rank])
                if end is None:
                    on_compute(rank, actions[pc[rank]])
                    pc[rank] += 1
                elif try_batch(rank, actions[pc[rank] : end]):
                    pc[rank] = end
                else:
                    break
                progress = True
    return pc


# ---------------------------------------------------------------------------
# Validation


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


def validate_schedule(
    schedule: Sequence[Sequence[Action]], p: int, m: int, v: int = 1, placement: Placement | None = None
) -> ScheduleStats:
    """Check that ``schedule`` is complete, ordered, matched and deadlock-free.

    Args:
        schedule: one action list per rank.
        p, m, v: ranks, micro-batches, stages per rank.
        placement: which rank holds which stage (``parallel.pipeline.schedule.placement_for``);
            None: the known placement (interleaved, then V) that every compute action
            of the schedule fits, or interleaved if none fits (errors then name it).

    Returns:
        ScheduleStats of the schedule.

    Raises:
        ScheduleError: with the offending action(s), rank(s) and position(s).
    """
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")
    if len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists but p={p}")
    if placement is None:
        placement = recognise_placement(schedule, p, v)
    elif (placement.p, placement.v) != (p, v):
        raise ScheduleError(f"placement has p={placement.p}, v={placement.v} but the schedule p={p}, v={v}")
    positions = _index_actions(schedule, placement, m)
    _check_complete(positions, placement.n, m)
    _check_grad_reduce(schedule)
    _check_dependencies(schedule, positions, placement)
    _check_matching(schedule, placement)
    _check_deadlock(schedule, placement)
    _check_pair_order(schedule, placement)
    return _stats(schedule)


def recognise_placement(schedule: Sequence[Sequence[Action]], p: int, v: int) -> Placement:
    """The first known placement (interleaved, V) that every compute action fits; else interleaved."""
    candidates = [Placement(p, v), Placement(p, v, v_shape=True)]
    for placement in candidates:
        if all(
            placement.rank_of(a.stage) == rank
            for rank, actions in enumerate(schedule)
            for a in actions
            if a.type.is_compute
        ):
            return placement
    return candidates[0]


def _index_actions(
    schedule: Sequence[Sequence[Action]], placement: Placement, m: int
) -> dict[Action, tuple[int, int]]:
    """Map each action to (rank, position); reject out-of-range, misplaced and duplicate actions."""
    positions: dict[Action, tuple[int, int]] = {}
    n = placement.n
    for rank, actions in enumerate(schedule):
        for pos, action in enumerate(actions):
            if action.type is ActionType.GRAD_REDUCE:
                continue
            if not (0 <= action.stage < n and 0 <= action.microbatch < m):
                raise ScheduleError(
                    f"{action} on rank {rank} at position {pos}: stage must be in [0, {n}) "
                    f"and microbatch in [0, {m})"
                )
            if placement.rank_of(action.stage) != rank:
                raise ScheduleError(
                    f"{action} runs on rank {rank} at position {pos}, but stage {action.stage} "
                    f"lives on rank {placement.rank_of(action.stage)}"
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
            present = {t for t in ActionType if t.is_compute and Action(t, s, mb) in positions}
            where = f"stage {s} micro-batch {mb}"
            if ActionType.FORWARD not in present:
                raise ScheduleError(
                    f"missing action {Action(ActionType.FORWARD, s, mb)} ({where} is never run forward)"
                )
            split = {ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT} & present
            if ActionType.BACKWARD in present and split:
                raise ScheduleError(f"{where} has both a full backward B and a split backward I/W")
            if ActionType.BACKWARD not in present and len(split) != 2:
                missing = (
                    Action(ActionType.BACKWARD, s, mb) if not split else Action(_other_half(split), s, mb)
                )
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


def _prerequisites(action: Action, placement: Placement) -> list[list[Action]]:
    """Actions that must precede ``action`` on its own rank (each inner list: any one of them).

    Cross-rank dependencies are carried by a recv (and the peer's send by the
    compute that produced it), so given matching and deadlock freedom, local order
    implies the global data dependencies.
    """
    t, s, mb = action.type, action.stage, action.microbatch
    rank, n = placement.rank_of(s), placement.n
    own_forward = Action(ActionType.FORWARD, s, mb)
    grads = [ActionType.BACKWARD, ActionType.BACKWARD_INPUT]
    if t is ActionType.FORWARD and s > 0:
        if placement.is_remote(s - 1, rank):
            return [[Action(ActionType.RECV_FORWARD, s, mb)]]
        return [[Action(ActionType.FORWARD, s - 1, mb)]]
    if t in INPUT_GRAD_TYPES:
        if s == n - 1:
            return [[own_forward]]
        if placement.is_remote(s + 1, rank):
            return [[own_forward], [Action(ActionType.RECV_BACKWARD, s, mb)]]
        return [[own_forward], [Action(g, s + 1, mb) for g in grads]]
    if t is ActionType.BACKWARD_WEIGHT:
        return [[Action(ActionType.BACKWARD_INPUT, s, mb)]]
    if t is ActionType.SEND_FORWARD:
        return [[own_forward]]
    if t is ActionType.SEND_BACKWARD:
        return [[Action(g, s, mb) for g in grads]]
    return []


def _check_dependencies(
    schedule: Sequence[Sequence[Action]], positions: dict[Action, tuple[int, int]], placement: Placement
) -> None:
    for rank, actions in enumerate(schedule):
        for pos, action in enumerate(actions):
            if action.type is ActionType.GRAD_REDUCE:
                continue
            _check_comm_is_needed(action, rank, placement)
            for options in _prerequisites(action, placement):
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


def _check_comm_is_needed(action: Action, rank: int, placement: Placement) -> None:
    """Reject comm actions towards a stage that does not exist or is on the same rank."""
    peer_stage = {
        ActionType.SEND_FORWARD: action.stage + 1,
        ActionType.RECV_FORWARD: action.stage - 1,
        ActionType.SEND_BACKWARD: action.stage - 1,
        ActionType.RECV_BACKWARD: action.stage + 1,
    }.get(action.type)
    if peer_stage is not None and not placement.is_remote(peer_stage, rank):
        raise ScheduleError(
            f"{action} on rank {rank}: stage {peer_stage} is not a stage on another rank, nothing to exchange"
        )


def _check_matching(schedule: Sequence[Sequence[Action]], placement: Placement) -> None:
    """Every send has its recv and vice versa."""
    present = {a for actions in schedule for a in actions if a.type.is_comm}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.type.is_comm and peer_action(a) not in present:
                kind = "send" if is_send(a) else "recv"
                raise ScheduleError(
                    f"{kind} {a} on rank {rank} has no matching {peer_action(a)} on rank "
                    f"{placement.rank_of(peer_action(a).stage)}"
                )


def _check_pair_order(schedule: Sequence[Sequence[Action]], placement: Placement) -> None:
    """NCCL p2p ignores tags: the k-th send from rank a to rank b meets the k-th recv
    posted on b from a, so both sides must list the messages in one order. (Given
    deadlock freedom only a reordering inside one batch can break this.)
    """
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.type.is_comm:
                other = placement.rank_of(peer_action(a).stage)
                if is_send(a):
                    sent.setdefault((rank, other), []).append(a)
                else:
                    received.setdefault((other, rank), []).append(a)
    for (src, dst), sends in sorted(sent.items()):
        for k, (snd, rcv) in enumerate(zip(sends, received[(src, dst)])):
            if message(snd) != message(rcv):
                raise ScheduleError(
                    f"p2p order mismatch from rank {src} to rank {dst}: message #{k} is {snd} on "
                    f"rank {src} but {rcv} on rank {dst} (p2p matches in posting order)"
                )


def _check_deadlock(schedule: Sequence[Sequence[Action]], placement: Placement) -> None:
    """Walk every rank (`walk_ranks`); a batch completes once each op's peer op is posted."""
    posted: set[Action] = set()

    def try_batch(rank: int, batch: Sequence[Action]) -> bool:
        posted.update(batch)
        return all(peer_action(a) in posted for a in batch)

    pc = walk_ranks(schedule, lambda rank, action: None, try_batch)
    if any(pc[r] < len(schedule[r]) for r in range(placement.p)):
        raise ScheduleError(
            "deadlock under batched p2p: " + _describe_blocked(schedule, pc, posted, placement)
        )


def _describe_blocked(
    schedule: Sequence[Sequence[Action]], pc: list[int], posted: set[Action], placement: Placement
) -> str:
    parts = []
    for rank, actions in enumerate(schedule):
        if pc[rank] >= len(actions):
            continue
        end = dict(comm_batches(actions))[pc[rank]]
        batch = actions[pc[rank] : end]
        waits = [
            f"{peer_action(a)} on rank {placement.rank_of(peer_action(a).stage)}"
            for a in batch
            if peer_action(a) not in posted
        ]
        parts.append(
            f"rank {rank} blocked at position {pc[rank]} on {_batch_text(batch)} "
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
            cells.append(_batch_text(actions[pos : starts[pos]]))
            pos = starts[pos]
        else:
            cells.append(str(actions[pos]))
            pos += 1
    return cells


def _batch_text(batch: Sequence[Action]) -> str:
    """A comm batch as errors and `format_schedule` show it: ``[SF0.0 RB0.0]``."""
    return "[" + " ".join(map(str, batch)) + "]"
