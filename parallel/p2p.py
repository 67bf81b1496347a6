"""Point-to-point transfers between pipeline neighbours, batched as the schedule says.

The executor hands over each maximal run of consecutive comm actions of its
schedule; they are posted together with `batch_isend_irecv` and waited on, which
is the semantics `parallel.validate.validate_schedule` proves deadlock-free.
Neighbours are ring neighbours on the pp axis (stage s on pp rank s % p), given
as global ranks so the default process group carries the messages.
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


def exchange(transfers: list[Transfer], group: dist.ProcessGroup | None = None) -> None:
    """Post every op of the batch, then wait for all of them.

    Gloo matches p2p messages by (peer, tag); NCCL by posting order (the
    schedule guarantees one order per pair) and ignores tags.
    """
    ops = []
    for t in transfers:
        for i, tensor in enumerate(t.tensors):
            fn = dist.isend if t.send else dist.irecv
            ops.append(
                dist.P2POp(
                    fn,
                    tensor if tensor.is_contiguous() else tensor.contiguous(),
                    t.peer,
                    group=group,
                    tag=t.tag * 8 + i,
                )
            )
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def message_tag(kind: int, stage: int, microbatch: int, m: int) -> int:
    """A tag unique per (direction, stage, micro-batch) within a flush (gloo matches on it)."""
    return (stage * m + microbatch) * 2 + kind


def empty_buffers(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    return [torch.empty(s, dtype=dtype, device=device) for s in shapes]
