"""The all-to-all token dispatcher: tokens to the ep ranks holding their experts, and back.

Owns the differentiable uneven all-to-all (`all_to_all`, backward = the reverse
all-to-all) and `AllToAllDispatcher`, the expert-parallel twin of the model's
`LocalDispatcher` (same two methods, swapped in by `parallel.expert.apply`).

Legend: P = ep size, E experts (global), E_l = E / P local experts, rank p of the ep
group holds experts [p E_l, (p + 1) E_l); N tokens of this rank's routing group (its
micro-batch), H d_model, A = kept assignments (top-2: at most 2N), C = the expert
buffer's length (the most tokens any local expert received).

    dispatch                                                      combine (the reverse)
      assignments with slot >= 0, sorted by expert (stable)        buffer rows -> received order
      counts (E,) --all_to_all--> counts from each peer (P, E_l)   rows --all_to_all^-1--> (A, H)
      one host read of both count tables (the splits)              out[token] += gate * row
      rows x[token] (A, H) --all_to_all--> received (R, H)         (index_add: (N, H))
      received rows -> sorted by local expert: grouped rows (R, H) for `torch._grouped_mm`
      where it runs on shapes it takes (`models.moe.experts.grouped_layout`), else the
      (E_l, C, H) buffer, zero-padded to the busiest local expert

Every kept assignment crosses once each way; capacity (when set) was already applied by
the router, which decided each rank's drops on its own routing group, so a mesh drops
exactly what one process routing the same micro-batches drops. The split sizes are
host numbers, so the dispatch reads the device once per sparse layer and micro-batch
(the count tables; again when remat recomputes the forward); the backward reuses them.
This read is what an uneven (dropless) all-to-all needs (Megatron's alltoall dispatcher
syncs the same way); capacity routing takes the same path so that both modes send only
kept tokens. Works on gloo and NCCL (`all_to_all_single` with uneven splits).

`bytes_sent` counts the payload bytes this rank sent to other ranks (forward and
backward, the count tables left out), host arithmetic on the splits.

`ReplicatedDispatcher` is for tokens every rank of the ep group holds alike (evaluation and
decoding, where the ep peers run the same batch): each rank runs its own experts on their
share of the tokens (the model's `LocalDispatcher` on the local expert range) and the ep
group sums the combined outputs (all-reduce forward, identity backward: Megatron's g, as
for tp). No all-to-all, no token sent; in fp32 the sum equals one process exactly (a
token's two weighted outputs, or one and a zero).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from models.moe import Experts, LocalDispatcher, Routing
from models.moe.experts import GroupedRows, grouped_layout
from parallel import watchdog
from parallel.tp.comm import reduce_from_tp


@dataclass
class A2AStats:
    """Host counters of one dispatcher (all sparse layers share one): payload bytes sent to other
    ranks and the number of all-to-alls, forward and backward."""

    bytes_sent: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.bytes_sent, self.calls = 0, 0


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `send` go to the group's ranks; `recv` rows come back from each."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, recv: list[int], send: list[int], group: ProcessGroup, stats: A2AStats | None
    ) -> Tensor:
        ctx.recv, ctx.send, ctx.group, ctx.stats = recv, send, group, stats
        return _exchange(x, recv, send, group, stats, "forward")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return _exchange(grad, ctx.send, ctx.recv, ctx.group, ctx.stats, "backward"), None, None, None, None


def _exchange(
    x: Tensor, recv: list[int], send: list[int], group: ProcessGroup, stats: A2AStats | None, phase: str
) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    if stats is not None:
        me = dist.get_rank(group)
        row = math.prod(x.shape[1:]) * x.element_size()
        stats.bytes_sent += row * (sum(send) - send[me])
        stats.calls += 1
    what = watchdog.collective(f"ep all-to-all of expert tokens ({phase})", group)
    with watchdog.waiting(what):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all(
    x: Tensor, recv: Sequence[int], send: Sequence[int], group: ProcessGroup, stats: A2AStats | None = None
) -> Tensor:
    """Differentiable uneven all-to-all along dim 0: `send[q]` rows of `x` (in order) go to rank q
    of `group`, `recv[q]` rows come from it; the backward sends the gradients back the same way."""
    return _AllToAll.apply(x, list(recv), list(send), group, stats)  # type: ignore[no-any-return]


@dataclass
class _DispatchCtx:
    token: Tensor  # (A,) token of each sent row, in send order
    gate: Tensor  # (A,) its combine weight
    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    index: Tensor  # (R,) flat position of each received row (buffer: e * C + c; grouped: its row)
    num_tokens: int


@dataclass
class _GroupedDispatchCtx(GroupedRows):
    """The grouped layout's `GroupedRows` (the experts read offs / expert / valid), with what
    `AllToAllDispatcher.combine` needs."""

    a2a: _DispatchCtx | None = None


class AllToAllDispatcher:
    """Expert-parallel dispatch over the ep group (see the module docstring).

    Args:
        group: this rank's ep group (P ranks, experts spread evenly, in rank order).
        stats: byte counter shared by the model's dispatchers (None: not counted).
    """

    def __init__(self, group: ProcessGroup, stats: A2AStats | None = None) -> None:
        self.group, self.stats = group, stats
        self.ep = dist.get_world_size(group)

    def dispatch(
        self, x: Tensor, routing: Routing, experts: Experts
    ) -> tuple[Tensor, _DispatchCtx | _GroupedDispatchCtx]:
        """Tokens (N, H) -> this rank's experts' rows (grouped, or the (E_l, C, H) buffer) and the context
        `combine` needs."""
        n, h = x.shape
        e_global = experts.num_experts
        e_local = e_global // self.ep
        # (2N,) assignment a = token a // 2, choice a % 2: its expert, or E where dropped. No
        # `nonzero` / `bincount` (each reads the device on CUDA): A is read with the counts.
        key = torch.where(routing.slot.reshape(-1) >= 0, routing.expert_index.reshape(-1), e_global)
        order = torch.argsort(key, stable=True)  # (2N,) kept ones by expert, then token; dropped last
        counts = torch.zeros(e_global + 1, dtype=torch.long, device=x.device)
        counts = counts.scatter_add_(0, key, torch.ones_like(key))[:e_global]  # (E,) rows to each expert
        from_peers = counts.new_empty(e_global)  # (P * E_l,): [q, j] rows peer q sends my expert j
        with watchdog.waiting(watchdog.collective("ep all-to-all of expert counts", self.group)):
            dist.all_to_all_single(from_peers, counts, group=self.group)
        host = torch.cat([counts, from_peers]).tolist()  # the one device read (see module docstring)
        send_e, recv_qe = host[:e_global], host[e_global:]
        send = [sum(send_e[q * e_local : (q + 1) * e_local]) for q in range(self.ep)]
        recv = [sum(recv_qe[q * e_local : (q + 1) * e_local]) for q in range(self.ep)]
        per_expert = [sum(recv_qe[q * e_local + j] for q in range(self.ep)) for j in range(e_local)]
        order = order[: sum(send_e)]  # (A,) the kept assignments
        token = order // 2
        rows = all_to_all(x.index_select(0, token), recv, send, self.group, self.stats)  # (R, H)
        gate = routing.gate.reshape(-1)[order]
        r = sum(recv)
        if r and grouped_layout(x, experts):  # rows sorted by local expert, no padding
            starts = [sum(per_expert[:j]) for j in range(e_local)]
            index = _row_index(recv_qe, self.ep, e_local, starts, x.device)  # (R,)
            ctx = _DispatchCtx(token, gate, send, recv, index, n)
            sizes = torch.tensor(per_expert, dtype=torch.long).to(x.device, non_blocking=True)
            groups = _GroupedDispatchCtx(
                offs=sizes.cumsum(0).to(torch.int32),
                expert=torch.repeat_interleave(torch.arange(e_local, device=x.device), sizes, output_size=r),
                valid=torch.ones(r, dtype=torch.bool, device=x.device),
                inverse=index.new_empty(0),
                a2a=ctx,
            )
            return rows.new_empty(r, h).index_copy(0, index, rows), groups
        cap = max(per_expert, default=0)
        index = _row_index(recv_qe, self.ep, e_local, [j * cap for j in range(e_local)], x.device)  # (R,)
        buffer = rows.new_zeros(e_local * cap, h).index_copy(0, index, rows).view(e_local, cap, h)
        return buffer, _DispatchCtx(token, gate, send, recv, index, n)

    def combine(self, y: Tensor, routing: Routing, ctx: _DispatchCtx | _GroupedDispatchCtx) -> Tensor:
        """Expert outputs (E_l, C, H) or grouped rows (R, H) -> tokens (N, H): each kept assignment's
        row times its gate, summed per token (a token's two choices; nothing for a dropped one)."""
        if isinstance(ctx, _GroupedDispatchCtx):
            assert ctx.a2a is not None
            ctx = ctx.a2a
        h = y.shape[-1]
        rows = y.reshape(-1, h).index_select(0, ctx.index)  # (R, H) in received order
        back = all_to_all(rows, ctx.send, ctx.recv, self.group, self.stats)  # (A, H) in send order
        weighted = back.float() * ctx.gate.unsqueeze(1).float()  # in fp32, as LocalDispatcher
        return weighted.new_zeros(ctx.num_tokens, h).index_add(0, ctx.token, weighted).to(y.dtype)


def _row_index(recv_qe: list[int], ep: int, e_local: int, starts: list[int], device: torch.device) -> Tensor:
    """Flat position `starts[j] + c` of every received row in the experts' layout (buffer: starts
    j * C; grouped: where expert j's group begins). Rows arrive grouped by peer q and, within a
    peer, by local expert j; expert j's rows are stacked in peer order. From the host count
    table: small (P, E_l) tables copied to the device, then one repeat_interleave."""
    counts = torch.tensor(recv_qe, dtype=torch.long).view(ep, e_local)  # (P, E_l)
    before_peer = counts.cumsum(0) - counts  # rows of expert j from peers before q
    base = (torch.tensor(starts, dtype=torch.long) + before_peer).reshape(
        -1
    )  # (P E_l,) first slot of each run
    flat = counts.reshape(-1)
    run_start = flat.cumsum(0) - flat  # first received row of each (q, j) run
    total = int(flat.sum())
    base, flat, run_start = (t.to(device, non_blocking=True) for t in (base, flat, run_start))
    offset = torch.repeat_interleave(base - run_start, flat, output_size=total)  # (R,)
    return offset + torch.arange(total, device=device)


class ReplicatedDispatcher(LocalDispatcher):
    """Dispatch of tokens replicated over the ep group (see the module docstring).

    Args:
        group: this rank's ep group.
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def combine(self, y: Tensor, routing: Routing, ctx: Tensor) -> Tensor:
        """This rank's experts' weighted outputs (N, H), summed over the ep group."""
        return reduce_from_tp(super().combine(y, routing, ctx), self.group)
