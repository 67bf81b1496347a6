"""Point-to-point transfers between pipeline neighbours, batched as the schedule says.

The executor hands over each maximal run of consecutive comm actions of its
schedule; they are posted together with `batch_isend_irecv` and the receives
waited on, which is (a relaxation of) the semantics
`parallel.validate.validate_schedule` proves deadlock-free.
The peer of a message is the pp rank holding the other stage (the schedule's
`Placement`: stage s on s % p, or ZB-V's V), given as a global rank so the
default process group carries the messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class Transfer:
    """One boundary message: send `tensors` to, or receive into `tensors` from, global rank `peer`."""

    send: bool
    peer: int
    tensors: list[Tensor]
    tag: int = 0


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
    ops, sends = [], []
    for t in transfers:
        for i, tensor in enumerate(t.tensors):
            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            ops.append(
                dist.P2POp(dist.isend if t.send else dist.irecv, buf, t.peer, group=group, tag=t.tag * 8 + i)
            )
            sends.append(t.send)
    if not ops:
        return []
    pending = []
    for op, work, is_send in zip(ops, dist.batch_isend_irecv(ops), sends):
        if is_send:
            pending.append(PendingSend(work, op.tensor))
        else:
            work.wait()
    return pending


@dataclass
class PendingSend:
    """A posted send and the buffer it reads, kept alive until the send completes."""

    work: dist.Work
    tensor: Tensor


def wait_sends(pending: list[PendingSend], only_completed: bool = False) -> list[PendingSend]:
    """Wait for the sends (or, with `only_completed`, just drop those already done); returns the rest."""
    if only_completed:
        return [s for s in pending if not s.work.is_completed()]
    for s in pending:
        s.work.wait()
    return []


def message_tag(kind: int, stage: int, microbatch: int, m: int) -> int:
    """A tag unique per (direction, stage, micro-batch) within a flush (gloo matches on it)."""
    return (stage * m + microbatch) * 2 + kind


def empty_buffers(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    return [torch.empty(s, dtype=dtype, device=device) for s in shapes]
