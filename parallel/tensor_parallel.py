"""Megatron-style tensor parallelism (tp), applied to the single-device model from outside.

Owns the tp communication operators (explicit `torch.autograd.Function`s over the
tp ProcessGroup), the parallel layers built *from* the model's existing
`nn.Linear` / `nn.Embedding` / `LMHead` (so a tp model starts from exactly the
single-device weights), the vocab-parallel cross-entropy, and
`apply_tensor_parallel`, which swaps them in by name (parameter names unchanged).

Legend: p = tp size, r = tp rank, B batch, T sequence, H d_model, F FFN width,
V real vocabulary, V' = V padded to a multiple of p, V/p = V' / p rows per rank.

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

Per Transformer layer (attention and FFN alike):

    X --f--> [X W_1 | ... | X W_p] (column: heads / F split) --> act/attn --> [Y_1 ... Y_p] W_2 --g--> Z
                                                            Z = sum_r Y_r W_2,r  (row: partial sums)

With sequence parallelism f/g become gather_seq / reduce_scatter_seq, and the
residual stream, layer norms and dropout between them hold T/p tokens per rank.

Conventions the trainer relies on:

* every parameter carries `tp_sharded` (bool): True for column-parallel weights and
  biases, row-parallel weights and the vocab-parallel embedding; False for layer
  norms and row-parallel biases (replicated on all tp ranks). `is_tp_sharded(p)`
  reads it. The global grad norm sums sharded parameters over tp and counts
  replicated ones once (`grad_norm_sq`);
* with sequence parallelism, replicated parameters used on sequence-split
  activations (in-layer norms, row-parallel biases) carry `sequence_parallel=True`
  and get partial gradients: call `sync_sequence_parallel_grads` after the backward
  passes of a step (Megatron's `allreduce_sequence_parallel_grads`);
* the vocabulary is padded from V to V' = ceil(V / p) * p; rank r holds rows
  [r V/p, (r+1) V/p) of the padded table; padding rows start at zero, are never
  looked up, their logits are filled with the dtype's minimum and the loss ignores
  them, so their gradient is exactly zero and they stay zero (no weight decay on 0).

RNG / dropout: every tp rank must be seeded identically (same `torch.manual_seed`
on the ranks of a tp group). Dropout on replicated activations (embedding, residual
stream without sequence parallelism) then draws identical masks on all tp ranks,
as it must. Dropout inside the split region (attention probabilities of the local
heads, FFN activations) draws masks of the same shape from the same state, i.e.
masks correlated across ranks rather than Megatron's per-rank RNG tracker; this is
a valid dropout in expectation but not the single-device one. The same holds
under sequence parallelism for dropout on the residual stream: each rank's T/p
slice draws the same mask pattern (Megatron forks a per-rank RNG there; we do not,
since `models/` calls `F.dropout` on the global generator). With dropout off,
parity with the single-device model is exact up to float summation order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from models.config import ModelConfig
from models.m2m100 import IGNORE_INDEX, Attention, DecoderLayer, EncoderLayer, LMHead, M2M100Translation
from parallel.mesh import ParallelMesh, check_tp_divides_model

# torch >= 2.9 names; the *_into_tensor spellings are deprecated there but exist since 2.0.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

SEQ_DIM = 1  # the model is batch-first: activations are (B, T, H)


# ----------------------------------------------------------------------------- collectives


def _size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def _all_reduce(x: Tensor, group: ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    if _size(group) == 1:
        return x
    out = x.contiguous().clone()
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


# ----------------------------------------------------------------------------- parameter marks


def _mark(param: nn.Parameter, sharded: bool, shard_dim: int | None = None) -> nn.Parameter:
    param.tp_sharded = sharded  # type: ignore[attr-defined]
    param.tp_shard_dim = shard_dim  # type: ignore[attr-defined]
    return param


def is_tp_sharded(param: Tensor) -> bool:
    """True if `param` holds a 1/p slice of a single-device parameter (else it is replicated over tp)."""
    return bool(getattr(param, "tp_sharded", False))


def is_sequence_parallel_param(param: Tensor) -> bool:
    """True if `param` is replicated but sees sequence-split activations (partial gradients)."""
    return bool(getattr(param, "sequence_parallel", False))


def _shard_rows(weight: Tensor, rank: int, p: int) -> Tensor:
    return weight.detach().chunk(p, dim=0)[rank].clone()


# ----------------------------------------------------------------------------- layers


class ColumnParallelLinear(nn.Module):
    """Y = X A with A = [A_1 ... A_p] split by output columns: rank r computes Y_r = X A_r.

    `nn.Linear` stores A^T as `weight` (out, in), so rank r keeps rows
    [r out/p, (r+1) out/p) of the weight and the same slice of the bias. The
    output stays split, (..., out/p), unless `gather_output`.
    """

    def __init__(
        self,
        linear: nn.Linear,
        group: ProcessGroup,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        communicate_input: bool = True,
    ) -> None:
        """Slice `linear` (not modified) for this tp rank.

        Args:
            linear: the single-device layer.
            group: the tp process group.
            gather_output: all-gather the output back to (..., out).
            sequence_parallel: the input is (B, T/p, H); all-gather it along T first.
            communicate_input: apply the input operator (f, or the T all-gather under
                sequence parallelism); False when the caller already applied it to an
                input shared by several column layers (q, k and v of one attention).

        Raises:
            ValueError: if tp does not divide `out_features`.
        """
        super().__init__()
        p, r = _size(group), _rank(group)
        if linear.out_features % p != 0:
            raise ValueError(f"tp({p}) does not divide out_features({linear.out_features})")
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.communicate_input = communicate_input
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _mark(nn.Parameter(_shard_rows(linear.weight, r, p)), True, 0)  # (out/p, in)
        self.bias = (
            None if linear.bias is None else _mark(nn.Parameter(_shard_rows(linear.bias, r, p)), True, 0)
        )

    # forward = output_transform(F.linear(input_transform(x), W_r, b_r)); the split lets
    # parallel.zero_bubble defer the weight gradient of the local matmul alone.
    bias_in_matmul = True

    def linear_input_transform(self, x: Tensor) -> Tensor:
        """f (or the T all-gather under sequence parallelism) before the local matmul."""
        if self.communicate_input and self.sequence_parallel:
            return gather_from_sequence_parallel(x, self.group)  # (B, T/p, in) -> (B, T, in)
        if self.communicate_input:
            return copy_to_tp(x, self.group)
        return x

    def linear_output_transform(self, y: Tensor) -> Tensor:
        """Optional all-gather of the (..., out/p) output."""
        return gather_from_tp(y, self.group) if self.gather_output else y

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out/p)
        y = F.linear(self.linear_input_transform(x), self.weight, self.bias)  # Y_r = X A_r + b_r
        return self.linear_output_transform(y)

    def extra_repr(self) -> str:
        p = _size(self.group)
        return (
            f"in={self.in_features}, out={self.out_features}/{p}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """Y = X A with A = [A_1; ...; A_p] split by input rows: Y = sum_r X_r A_r (all-reduce).

    Rank r keeps columns [r in/p, (r+1) in/p) of `weight` (out, in). The bias is
    replicated and added once, after the reduction.
    """

    def __init__(
        self,
        linear: nn.Linear,
        group: ProcessGroup,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        """Slice `linear` (not modified) for this tp rank.

        Args:
            linear: the single-device layer.
            group: the tp process group.
            input_is_parallel: the input is already split (..., in/p); else split it here.
            sequence_parallel: reduce-scatter the output along T to (B, T/p, out).

        Raises:
            ValueError: if tp does not divide `in_features`.
        """
        super().__init__()
        p, r = _size(group), _rank(group)
        if linear.in_features % p != 0:
            raise ValueError(f"tp({p}) does not divide in_features({linear.in_features})")
        self.group, self.input_is_parallel, self.sequence_parallel = (
            group,
            input_is_parallel,
            sequence_parallel,
        )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().chunk(p, dim=1)[r].clone()
        self.weight = _mark(nn.Parameter(w), True, 1)  # (out, in/p)
        self.bias: nn.Parameter | None = None
        if linear.bias is not None:
            self.bias = _mark(nn.Parameter(linear.bias.detach().clone()), False)
            self.bias.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]

    # forward = output_transform(F.linear(input_transform(x), W_r)); the bias is not in
    # the matmul (it is added once, after the reduction).
    bias_in_matmul = False

    def linear_input_transform(self, x: Tensor) -> Tensor:
        """Split the input's last dim here unless it arrives split."""
        return x if self.input_is_parallel else scatter_to_tp(x, self.group)

    def linear_output_transform(self, partial: Tensor) -> Tensor:
        """g (or the T reduce-scatter under sequence parallelism) of X_r A_r, then + b."""
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(partial, self.group)  # (B, T/p, out)
        else:
            y = reduce_from_tp(partial, self.group)  # sum_r X_r A_r
        return y if self.bias is None else y + self.bias

    def forward(self, x: Tensor) -> Tensor:  # (..., in/p) -> (..., out)
        return self.linear_output_transform(F.linear(self.linear_input_transform(x), self.weight))

    def extra_repr(self) -> str:
        p = _size(self.group)
        return (
            f"in={self.in_features}/{p}, out={self.out_features}, sequence_parallel={self.sequence_parallel}"
        )


def vocab_partition(vocab_size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(padded vocab V', start, end) of rank's contiguous slice [start, end) of the padded vocab.

    Raises:
        ValueError: on a non-positive size or an out-of-range rank.
    """
    if vocab_size < 1 or tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"bad vocab partition: vocab_size={vocab_size}, tp={tp}, rank={rank}")
    padded = -(-vocab_size // tp) * tp
    per = padded // tp
    return padded, rank * per, (rank + 1) * per


class VocabParallelEmbedding(nn.Module):
    """E = [E_1; ...; E_p] split by vocabulary rows; out = sum_r lookup_r(ids) (all-reduce).

    Ids outside this rank's slice look up zeros; the vocabulary is padded to V'
    with zero rows that no id reaches.
    """

    def __init__(self, embedding: nn.Embedding, group: ProcessGroup) -> None:
        """Slice `embedding` (not modified) for this tp rank.

        Args:
            embedding: the single-device (V, H) embedding.
            group: the tp process group.
        """
        super().__init__()
        p, r = _size(group), _rank(group)
        self.group = group
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padded_vocab_size, self.vocab_start, self.vocab_end = vocab_partition(self.num_embeddings, p, r)
        w = embedding.weight.detach()
        local = w.new_zeros(self.vocab_end - self.vocab_start, self.embedding_dim)  # (V/p, H)
        real_end = min(self.vocab_end, self.num_embeddings)
        if real_end > self.vocab_start:
            local[: real_end - self.vocab_start] = w[self.vocab_start : real_end]
        self.weight = _mark(nn.Parameter(local), True, 0)
        pad = embedding.padding_idx
        self.padding_idx = pad
        self.local_padding_idx = (
            pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        )

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) -> (B, T, H)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # zero rows (and gradients) of foreign ids
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings} (padded {self.padded_vocab_size}), "
            f"slice=[{self.vocab_start}, {self.vocab_end}), dim={self.embedding_dim}"
        )


class VocabParallelLMHead(nn.Module):
    """logits_r = h E_r^T: this rank's (B, T, V/p) shard of the logits, never gathered.

    Replaces the model's `LMHead`; `weight` is the vocab-parallel shared embedding's
    local (V/p, H) slice. Padding columns (ids >= V) are filled with the dtype's
    minimum so nothing ever predicts them (and their gradient is zero).
    """

    def __init__(
        self, group: ProcessGroup, vocab_size: int, vocab_start: int, sequence_parallel: bool = False
    ) -> None:
        """Args:
        group: the tp process group.
        vocab_size: the real vocabulary size V.
        vocab_start: first (padded-vocab) id of this rank's slice.
        sequence_parallel: the input is (B, T/p, H); all-gather it along T first.
        """
        super().__init__()
        self.group, self.vocab_size, self.vocab_start = group, vocab_size, vocab_start
        self.sequence_parallel = sequence_parallel

    def forward(self, h: Tensor, weight: Tensor) -> Tensor:  # (B, T, H) x (V/p, H) -> (B, T, V/p)
        h = (
            gather_from_sequence_parallel(h, self.group)
            if self.sequence_parallel
            else copy_to_tp(h, self.group)
        )
        logits = F.linear(h, weight)
        n_real = self.vocab_size - self.vocab_start
        if n_real < logits.shape[-1]:
            pad = torch.arange(logits.shape[-1], device=logits.device) >= n_real  # (V/p,)
            logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
        return logits


# ----------------------------------------------------------------------------- loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum of label-smoothed token losses from vocab-sharded logits (Megatron's
    `_VocabParallelCrossEntropy`), with three all-reduces of (N,) vectors and no
    gather of the (N, V) logits:

        m = max_j z_j,   Z = sum_j exp(z_j - m),   log p_j = z_j - m - log Z
        loss = (1 - eps) (-log p_t) + eps * mean_{j < V} (-log p_j)
        d loss / d z_j = p_j - (1 - eps) [j = t] - eps / V [j < V]
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,  # (N, V/p)
        target: Tensor,  # (N,)
        group: ProcessGroup,
        vocab_start: int,
        vocab_size: int,
        eps: float,
        ignore_index: int,
    ) -> Tensor:
        z = logits.float()
        n_local = z.shape[-1]
        real = (torch.arange(n_local, device=z.device) + vocab_start) < vocab_size  # (V/p,)
        m = z.masked_fill(~real, float("-inf")).amax(dim=-1)  # (N,)
        m = _all_reduce(m, group, dist.ReduceOp.MAX)
        shifted = z - m.unsqueeze(-1)  # (N, V/p)
        exp = shifted.exp().masked_fill(~real, 0.0)
        sum_exp = _all_reduce(exp.sum(dim=-1), group)  # (N,) = Z
        valid = target != ignore_index
        local_t = target - vocab_start
        mine = valid & (local_t >= 0) & (local_t < n_local)
        local_t = local_t.masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        picked = _all_reduce(picked, group)  # (N,) = z_t - m
        log_z = sum_exp.log()
        loss = log_z - picked  # -log p_t
        if eps > 0.0:
            sum_shifted = _all_reduce(shifted.masked_fill(~real, 0.0).sum(dim=-1), group)
            loss = (1.0 - eps) * loss + eps * (log_z - sum_shifted / vocab_size)
        loss = loss.masked_fill(~valid, 0.0)
        softmax = exp / sum_exp.unsqueeze(-1)  # (N, V/p), 0 on padding
        ctx.save_for_backward(softmax, local_t, mine, valid, real)
        ctx.eps, ctx.vocab_size, ctx.dtype = eps, vocab_size, logits.dtype
        return loss.sum()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        softmax, local_t, mine, valid, real = ctx.saved_tensors
        eps, vocab_size = ctx.eps, ctx.vocab_size
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (1.0 - eps) * mine.to(grad.dtype)
        if eps > 0.0:
            grad -= (eps / vocab_size) * real.to(grad.dtype)
        grad *= valid.to(grad.dtype).unsqueeze(-1) * grad_out
        return grad.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: Tensor,
    labels: Tensor,
    tp_group: ProcessGroup,
    vocab_start: int,
    vocab_size_real: int,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum of token cross-entropies from this rank's logit shard.

    Same convention as `models.m2m100.cross_entropy_sum` (and `F.cross_entropy(...,
    reduction="sum", label_smoothing=eps)` on the full logits), without gathering
    them. Padded vocabulary entries (ids >= `vocab_size_real`) take no part,
    not even in label smoothing's uniform term.

    Args:
        local_logits: (B, T, V/p) this rank's slice of the padded vocabulary.
        labels: (B, T) target ids, `ignore_index` where no loss.
        tp_group: the tp process group.
        vocab_start: first id of this rank's slice.
        vocab_size_real: V, the unpadded vocabulary size.
        label_smoothing: eps in [0, 1).
        ignore_index: label value that carries no loss.

    Returns:
        The loss sum: a scalar fp32 tensor, identical on all tp ranks (the token
        count is a host number: `Seq2SeqBatch.num_tokens`).
    """
    flat = local_logits.reshape(-1, local_logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(  # type: ignore[no-any-return]
        flat, labels.reshape(-1), tp_group, vocab_start, vocab_size_real, float(label_smoothing), ignore_index
    )


def gather_logits(local_logits: Tensor, tp_group: ProcessGroup, vocab_size_real: int) -> Tensor:
    """(B, T, V/p) shards -> full (B, T, V) logits without the padding (evaluation, generation)."""
    return gather_from_tp(local_logits, tp_group)[..., :vocab_size_real]


# ----------------------------------------------------------------------------- applying tp


@dataclass
class TensorParallelInfo:
    """What the trainer needs after `apply_tensor_parallel`.

    Attributes:
        group: the tp process group.
        tp_size, tp_rank: size of and position in it.
        vocab_size: real vocabulary V.
        padded_vocab_size: V' (multiple of tp).
        vocab_start, vocab_end: this rank's slice [start, end) of the padded vocabulary.
        sequence_parallel: whether sequence parallelism is on.
    """

    group: ProcessGroup
    tp_size: int
    tp_rank: int
    vocab_size: int
    padded_vocab_size: int
    vocab_start: int
    vocab_end: int
    sequence_parallel: bool = False

    def loss(self, local_logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
        """`vocab_parallel_cross_entropy` with this rank's vocab slice: the loss sum."""
        return vocab_parallel_cross_entropy(
            local_logits, labels, self.group, self.vocab_start, self.vocab_size, label_smoothing
        )

    def gather_logits(self, local_logits: Tensor) -> Tensor:
        """Full (B, T, V) logits, padding dropped."""
        return gather_logits(local_logits, self.group, self.vocab_size)


def _resolve_group(tp: ProcessGroup | ParallelMesh | DeviceMesh) -> ProcessGroup:
    if isinstance(tp, ParallelMesh):
        return tp.group("tp")
    if isinstance(tp, DeviceMesh):
        return tp.get_group("tp") if tp.mesh_dim_names and "tp" in tp.mesh_dim_names else tp.get_group()
    return tp


def _swap_linear(owner: nn.Module, name: str, parallel: Any, group: ProcessGroup, **kwargs: Any) -> None:
    # Only plain nn.Linear is swapped, so applying tp twice never re-slices a shard.
    linear = getattr(owner, name)
    if isinstance(linear, nn.Linear):
        setattr(owner, name, parallel(linear, group, **kwargs))


def _parallelize_attention(attn: Attention, group: ProcessGroup, sp: bool, cross: bool) -> None:
    # Heads are contiguous blocks of q/k/v's output columns, so a column split hands
    # rank r heads [r h/p, (r+1) h/p); out_proj's matching input columns are a row split.
    # Under sequence parallelism the attention input is all-gathered along T once, by a
    # pre-hook (`enable_sequence_parallel`), because `Attention.forward` reads T from
    # its input; q (and self-attention k, v) then take it as is. Cross-attention k, v
    # read the replicated encoder output: plain f there.
    # Without sequence parallelism, q, k and v read the same input: one f per input (a
    # pre-hook on the attention) instead of one per projection saves two (self) or one
    # (cross) backward all-reduces per attention.
    _swap_linear(attn, "q_proj", ColumnParallelLinear, group, communicate_input=False)
    for name in ("k_proj", "v_proj"):
        _swap_linear(attn, name, ColumnParallelLinear, group, communicate_input=sp and cross)
    _swap_linear(attn, "out_proj", RowParallelLinear, group, sequence_parallel=sp)
    if not sp and not getattr(attn, "_tp_input_hook", False):
        attn.register_forward_pre_hook(_copy_attention_inputs(group), with_kwargs=True)
        attn._tp_input_hook = True  # type: ignore[assignment]


def _copy_attention_inputs(group: ProcessGroup) -> Any:
    """Pre-hook: f (identity forward, all-reduce backward) once on x and once on kv."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        args = (copy_to_tp(args[0], group), *args[1:]) if args else args
        if "x" in kwargs:
            kwargs["x"] = copy_to_tp(kwargs["x"], group)
        if kwargs.get("kv") is not None:
            kwargs["kv"] = copy_to_tp(kwargs["kv"], group)
        return args, kwargs

    return hook


def _parallelize_ffn(layer: EncoderLayer | DecoderLayer, group: ProcessGroup, sp: bool) -> None:
    # FFN: Y = act(X W_1) W_2 with W_1 column-split and W_2 row-split (one all-reduce).
    _swap_linear(layer, "fc1", ColumnParallelLinear, group, sequence_parallel=sp)
    _swap_linear(layer, "fc2", RowParallelLinear, group, sequence_parallel=sp)


def apply_tensor_parallel(
    model: M2M100Translation,
    tp: ProcessGroup | ParallelMesh | DeviceMesh,
    sequence_parallel: bool = False,
) -> TensorParallelInfo:
    """Shard a (possibly pipeline-pruned) model in place, Megatron-style.

    In every attention q/k/v become column-parallel and out_proj row-parallel; in
    every layer fc1 column-, fc2 row-parallel; `shared` becomes a
    VocabParallelEmbedding and `lm_head` a VocabParallelLMHead, which returns
    (B, T, V/p) logit shards (use `info.loss`). Parameter names are unchanged.
    Every rank of the tp group must hold the same single-device weights (seed
    identically) and call this; it makes no collective itself.

    Args:
        model: the model, after `keep_only` for a pipeline stage if any.
        tp: the tp process group, or a ParallelMesh / DeviceMesh with a "tp" axis.
        sequence_parallel: split layer norms and dropout along T between layers
            (see `enable_sequence_parallel`).

    Returns:
        TensorParallelInfo (padded vocab, this rank's vocab slice, the group).

    Raises:
        ValueError: if tp does not divide heads, FFN widths or d_model.
    """
    group = _resolve_group(tp)
    p, r = _size(group), _rank(group)
    config: ModelConfig = model.config
    check_tp_divides_model(config, p)
    padded, start, end = vocab_partition(config.vocab_size, p, r)
    for module in list(model.modules()):
        if isinstance(module, EncoderLayer | DecoderLayer):
            _parallelize_attention(module.self_attn, group, sequence_parallel, cross=False)
            if isinstance(module, DecoderLayer):
                _parallelize_attention(module.encoder_attn, group, sequence_parallel, cross=True)
            _parallelize_ffn(module, group, sequence_parallel)
    if isinstance(model.shared, nn.Embedding):
        model.shared = VocabParallelEmbedding(model.shared, group)
    if isinstance(model.lm_head, LMHead):
        # The final norm's output is replicated (sequence parallelism ends with the last
        # layer, see `enable_sequence_parallel`), so the head takes plain f.
        model.lm_head = VocabParallelLMHead(group, config.vocab_size, start)
    for param in model.parameters():
        if not hasattr(param, "tp_sharded"):
            _mark(param, False)
    if sequence_parallel:
        enable_sequence_parallel(model, group)
    return TensorParallelInfo(group, p, r, config.vocab_size, padded, start, end, sequence_parallel)


# ----------------------------------------------------------------------------- sequence parallelism


def enable_sequence_parallel(model: M2M100Translation, group: ProcessGroup) -> None:
    """Keep the residual stream split along T inside each run of consecutive layers.

    Hooks (no renamed parameters) on the layers of every encoder/decoder stack:
    the first layer of a run of consecutive indices splits its input `x` along T
    (`scatter_to_sequence_parallel`), the last all-gathers its output
    (`gather_sequence_parallel_to_replicated`). In between, layer norms, residual
    adds and dropout work on (B, T/p, H); column-parallel layers all-gather T
    before their matmul and row-parallel layers reduce-scatter T after it.
    Everything outside the layers (embeddings, final norms, the head, the encoder
    output fed to cross-attention) stays replicated, as without sequence parallelism.

    Called by `apply_tensor_parallel(sequence_parallel=True)` after the linear layers
    were made sequence-parallel. Marks in-layer layer-norm parameters and
    row-parallel biases `sequence_parallel=True`: their gradients are partial sums
    over the sequence slices; `sync_sequence_parallel_grads` completes them.

    Requires T (and S) divisible by tp: pad batches to a multiple of tp.
    """
    for stack in (model.encoder, model.decoder):
        keys = sorted(int(k) for k in stack.layers.keys())
        for i in keys:
            layer = stack.layers[str(i)]
            for sub in layer.modules():
                if isinstance(sub, nn.LayerNorm):
                    for param in sub.parameters():
                        param.sequence_parallel = True  # type: ignore[attr-defined]
                if isinstance(sub, Attention):
                    sub.register_forward_pre_hook(_make_attention_gather_hook(group))
            if i - 1 not in keys:
                layer.register_forward_pre_hook(_make_scatter_hook(group))
            if i + 1 not in keys:
                layer.register_forward_hook(_make_gather_hook(group))


def _make_scatter_hook(group: ProcessGroup) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        p = _size(group)
        if x.shape[SEQ_DIM] % p != 0:
            raise ValueError(
                f"sequence_parallel needs the sequence length ({x.shape[SEQ_DIM]}) divisible by tp({p}); "
                f"pad batches to a multiple of {p}"
            )
        return (scatter_to_sequence_parallel(x, group), *args[1:])

    return hook


def _make_attention_gather_hook(group: ProcessGroup) -> Any:
    # (B, T/p, H) -> (B, T, H) for q (and self-attention k, v); backward reduce-scatters.
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (gather_from_sequence_parallel(args[0], group), *args[1:])

    return hook


def _make_gather_hook(group: ProcessGroup) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        return gather_sequence_parallel_to_replicated(output, group)

    return hook


def sync_sequence_parallel_grads(model: nn.Module, tp_group: ProcessGroup) -> None:
    """All-reduce over tp the gradients of replicated parameters used on sequence-split activations.

    Call once per optimizer step, after all backward passes and before the dp
    reduction / grad-norm; a no-op without sequence parallelism. One flat
    all-reduce, in `named_parameters` order (identical on all tp ranks).
    """
    grads = [p.grad for p in model.parameters() if is_sequence_parallel_param(p) and p.grad is not None]
    if not grads or _size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


# ----------------------------------------------------------------------------- norms and export


def grad_norm_sq(params: Iterable[nn.Parameter], tp_group: ProcessGroup) -> Tensor:
    """Squared L2 norm of the gradients over the tp group: sharded parameters summed over
    ranks, replicated ones counted once. Returns an fp32 scalar identical on all tp ranks
    (still to be summed over pp, and over dp if gradients are sharded there)."""
    sharded: list[Tensor] = []
    replicated: list[Tensor] = []
    for param in params:
        if param.grad is not None:
            sq = param.grad.detach().float().pow(2).sum()
            (sharded if is_tp_sharded(param) else replicated).append(sq)
    device = (sharded + replicated)[0].device if sharded or replicated else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float32, device=device)
    total_sharded = torch.stack(sharded).sum() if sharded else zero
    total_replicated = torch.stack(replicated).sum() if replicated else zero
    return _all_reduce(total_sharded, tp_group) + total_replicated


def _named_tensors(model: nn.Module, grads: bool) -> Iterator[tuple[str, Tensor, nn.Parameter | None]]:
    if grads:
        for name, param in model.named_parameters():
            if param.grad is not None:
                yield name, param.grad, param
        return
    params = dict(model.named_parameters())
    for name, tensor in model.state_dict().items():
        yield name, tensor, params.get(name)


def gather_full_state_dict(
    model: nn.Module, tp_group: ProcessGroup, grads: bool = False
) -> dict[str, Tensor]:
    """The single-device state dict (or gradients) of a tp-sharded model (collective over tp).

    Names are the single-device ones; the vocabulary is cut back to V rows.
    Every tp rank gets the full tensors (on the parameters' device).

    Args:
        model: a model after `apply_tensor_parallel`.
        tp_group: its tp group.
        grads: gather `param.grad` (parameters with a gradient) instead of the state dict.

    Returns:
        name -> full tensor (detached copies).
    """
    vocab_size: int | None = getattr(getattr(model, "config", None), "vocab_size", None)
    out: dict[str, Tensor] = {}
    for name, tensor, param in _named_tensors(model, grads):
        full = tensor.detach()
        if param is not None and is_tp_sharded(param):
            full = _all_gather(full, int(param.tp_shard_dim), tp_group)  # type: ignore[attr-defined]
            if name.split(".")[0] == "shared" and vocab_size is not None:
                full = full[:vocab_size]
        out[name] = full.clone()
    return out
