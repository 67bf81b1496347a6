"""Tensor-parallel (tp) communication: collectives and the autograd operators over the tp group.

Owns the explicit `torch.autograd.Function`s over the tp ProcessGroup that the
parallel layers (`parallel.tp.layers`) and the sequence-parallel hooks
(`parallel.tp.apply`) put around local matmuls, and the raw collective helpers
(`_all_reduce`, `_all_gather`, `_reduce_scatter`, `_split`) the rest of
`parallel.tp` builds on. Every helper is a no-op on a 1-rank group.

Legend: p = tp size, r = tp rank, B batch, T sequence, H d_model, D any last dim.

Conjugate operators (Shoeybi et al. 2019, "Megatron-LM", Sec. 3; fig. 3):

    copy_to_tp      f: forward identity       backward all-reduce
    reduce_from_tp  g: forward all-reduce     backward identity
    gather_last     forward all-gather(-1)    backward split(-1)
    scatter_last    forward split(-1)         backward all-gather(-1)

and for sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation", Sec. 4.2.2), along the sequence dim (1 of (B, T, H)):

    gather_seq      g-bar: forward all-gather(T)      backward reduce-scatter(T)
    reduce_scatter_seq  : forward reduce-scatter(T)   backward all-gather(T)
    scatter_seq         : forward split(T)            backward all-gather(T)
    gather_seq_replicated: forward all-gather(T)      backward split(T)

`ShardOnlyGroup` stands in for a tp group where one rank's share is profiled alone
(`parallel.pipeline.profile`): the layers take its widths, and every collective keeps the
shapes and allocations it has on the real group without moving data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

# torch >= 2.9 names; the *_into_tensor spellings are deprecated there but exist since 2.0.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

SEQ_DIM = 1  # the model is batch-first: activations are (B, T, H)


# ----------------------------------------------------------------------------- collectives


class ShardOnlyGroup(dist.ProcessGroup):
    """Rank `rank` of a tp group of `size`, computed alone: no process, no data moved.

    For profiling one rank's share of a block without the other ranks (`parallel.pipeline.
    profile`): the parallel layers slice their weights to this rank's widths, and each
    collective returns a tensor of the shape the real one returns, allocated as it is (an
    all-reduce a copy of the local input, an all-gather `size` copies of it, a reduce-scatter
    this rank's chunk). The compute and the bytes autograd saves are the real rank's; the
    values are not (they would need the other ranks' parts), nor is the time of the
    communication itself, which the planner's link model prices.
    """

    def __init__(self, size: int, rank: int) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"bad shard: rank {rank} of {size}")
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs list only the store overload
        self.shard_rank = rank


def _size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _rank(group: ProcessGroup) -> int:
    return group.shard_rank if isinstance(group, ShardOnlyGroup) else dist.get_rank(group)


def _all_reduce(x: Tensor, group: ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    if _size(group) == 1:
        return x
    out = x.contiguous().clone()
    if not isinstance(group, ShardOnlyGroup):
        dist.all_reduce(out, op=op, group=group)
    return out


def _split(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    p = _size(group)
    if p == 1:
        return x
    if x.shape[dim] % p != 0:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by tp({p})")
    return x.chunk(p, dim=dim)[_rank(group)].contiguous()


def _all_gather(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    p = _size(group)
    if p == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()  # gather along dim 0, the collective's layout
    out = moved.new_empty((moved.shape[0] * p, *moved.shape[1:]))
    if isinstance(group, ShardOnlyGroup):
        out.copy_(moved.repeat(p, *([1] * (moved.dim() - 1))))
    else:
        _all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    p = _size(group)
    if p == 1:
        return x
    if x.shape[dim] % p != 0:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by tp({p})")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // p, *moved.shape[1:]))
    if isinstance(group, ShardOnlyGroup):
        out.copy_(moved.chunk(p)[group.shard_rank])
    else:
        _reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


class _GatherLast(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _split(grad, -1, ctx.group), None


class _ScatterLast(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_gather(grad, -1, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    """All-gather along T forward; reduce-scatter backward (input of a column layer under SP)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    """Reduce-scatter along T forward; all-gather backward (output of a row layer under SP)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """Replicated -> sequence-split: split along T forward; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherSeqReplicated(torch.autograd.Function):
    """Sequence-split -> replicated: all-gather along T forward; split backward.

    The backward keeps only this rank's slice because downstream of here the
    computation is replicated and its gradient is identical on every tp rank.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _split(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x: Tensor, group: ProcessGroup) -> Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return _CopyToTP.apply(x, group)  # type: ignore[no-any-return]


def reduce_from_tp(x: Tensor, group: ProcessGroup) -> Tensor:
    """Megatron's g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group)  # type: ignore[no-any-return]


def gather_from_tp(x: Tensor, group: ProcessGroup) -> Tensor:
    """(..., D/p) -> (..., D): all-gather along the last dim; backward keeps the local slice."""
    return _GatherLast.apply(x, group)  # type: ignore[no-any-return]


def scatter_to_tp(x: Tensor, group: ProcessGroup) -> Tensor:
    """(..., D) -> (..., D/p): this rank's slice of the last dim; backward all-gathers."""
    return _ScatterLast.apply(x, group)  # type: ignore[no-any-return]


def gather_from_sequence_parallel(x: Tensor, group: ProcessGroup) -> Tensor:
    """(B, T/p, H) -> (B, T, H) before a column-parallel layer; backward reduce-scatters."""
    return _GatherSeq.apply(x, group)  # type: ignore[no-any-return]


def reduce_scatter_to_sequence_parallel(x: Tensor, group: ProcessGroup) -> Tensor:
    """(B, T, H) partial sums -> (B, T/p, H) reduced, after a row-parallel layer; backward all-gathers."""
    return _ReduceScatterSeq.apply(x, group)  # type: ignore[no-any-return]


def scatter_to_sequence_parallel(x: Tensor, group: ProcessGroup) -> Tensor:
    """Replicated (B, T, H) -> this rank's (B, T/p, H); backward all-gathers."""
    return _ScatterSeq.apply(x, group)  # type: ignore[no-any-return]


def gather_sequence_parallel_to_replicated(x: Tensor, group: ProcessGroup) -> Tensor:
    """(B, T/p, H) -> replicated (B, T, H); backward keeps the local slice."""
    return _GatherSeqReplicated.apply(x, group)  # type: ignore[no-any-return]
