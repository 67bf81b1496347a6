"""Point-to-point transfers between pipeline neighbours, batched as the schedule says.

The executor hands over each maximal run of consecutive comm actions of its
schedule; they are posted together with `batch_isend_irecv` and the receives
waited on, which is (a relaxation of) the semantics
`parallel.pipeline.validate.validate_schedule` proves deadlock-free.
The peer of a message is the pp rank holding the other stage (the schedule's
`Placement`: stage s on s % p, or ZB-V's V), given as a global rank so the
default process group carries the messages.
Every blocking wait goes through `parallel.watchdog.wait`, so a timeout names the
waiting rank and the action it waited on, and the watchdog warns before that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from parallel import watchdog
from parallel.pipeline.schedule import Action, ActionType
from parallel.watchdog import RankIdentity


@dataclass
class Transfer:
    """One boundary message: send `tensors` to, or receive into `tensors` from, global rank `peer`.

    `action` is the schedule's SF/RF/SB/RB that posted it, for messages about waits.
    """

    send: bool
    peer: int
    tensors: list[Tensor]
    tag: int = 0
    action: Action | None = None

    def describe(self, me: RankIdentity | None) -> str:
        """What waiting on this transfer means, e.g. "the activations of micro-batch 3 for stage 1
        (RF1.3) from pp rank 0 (global rank 0)"."""
        peer = me.peer(self.peer) if me is not None else f"global rank {self.peer}"
        a = self.action
        if a is None:
            return f"the message with tag {self.tag} {'to' if self.send else 'from'} {peer}"
        forward = a.type in (ActionType.SEND_FORWARD, ActionType.RECV_FORWARD)
        payload = "activations" if forward else "input gradients"
        if self.send:
            return f"{peer} to take the {payload} of micro-batch {a.microbatch} of stage {a.stage} ({a})"
        return f"the {payload} of micro-batch {a.microbatch} for stage {a.stage} ({a}) from {peer}"


def exchange(transfers: list[Transfer], group: dist.ProcessGroup | None = None) -> list[PendingSend]:
    """Post every op of the batch, wait for its receives, and return its sends still in flight.

    Gloo matches p2p messages by (peer, tag); NCCL by posting order (the
    schedule guarantees one order per pair) and ignores tags.

    Sends are not waited for here: the caller keeps them (and so their buffers)
    until `wait_sends`, as PyTorch's pipelining schedules do. Waiting for a send
    later than the batch it was posted in only relaxes the batched semantics the
    validator proves deadlock-free, and matches the simulator's buffered sends; a
    rank no longer stalls until its peer reaches the matching receive.
    """
    ops, owners = [], []
    for t in transfers:
        for i, tensor in enumerate(t.tensors):
            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            ops.append(
                dist.P2POp(dist.isend if t.send else dist.irecv, buf, t.peer, group=group, tag=t.tag * 8 + i)
            )
            owners.append(t)
    if not ops:
        return []
    pending = []
    for op, work, t in zip(ops, dist.batch_isend_irecv(ops), owners):
        if t.send:
            pending.append(PendingSend(work, op.tensor, t))
        else:
            watchdog.wait(work, t.describe)
    return pending


@dataclass
class PendingSend:
    """A posted send and the buffer it reads, kept alive until the send completes."""

    work: dist.Work
    tensor: Tensor
    transfer: Transfer | None = None


def wait_sends(pending: list[PendingSend], only_completed: bool = False) -> list[PendingSend]:
    """Wait for the sends (or, with `only_completed`, just drop those already done); returns the rest."""
    if only_completed:
        return [s for s in pending if not s.work.is_completed()]
    for s in pending:
        watchdog.wait(s.work, s.transfer.describe if s.transfer is not None else "a send to a pp neighbour")
    return []


def message_tag(kind: int, stage: int, microbatch: int, m: int) -> int:
    """A tag unique per (direction, stage, micro-batch) within a flush (gloo matches on it)."""
    return (stage * m + microbatch) * 2 + kind


def empty_buffers(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    return [torch.empty(s, dtype=dtype, device=device) for s in shapes]
