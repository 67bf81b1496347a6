"""Tensor-parallel layers, built *from* the model's existing `nn.Linear` / `nn.Embedding` / `LMHead`.

Owns ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
VocabParallelLMHead, the vocabulary partition (`vocab_partition`) and the
parameter marks the trainer reads (`is_tp_sharded`, `is_sequence_parallel_param`).
Each layer slices the single-device weights it is given, so a tp model starts
from exactly the single-device weights; its communication is the f / g operators
of `parallel.tp.comm`.

Legend: p = tp size, r = tp rank, B batch, T sequence, H d_model, F FFN width,
V real vocabulary, V' = V padded to a multiple of p, V/p = V' / p rows per rank.

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
  replicated ones once (`parallel.grads.grad_sq_over_tp`);
* the vocabulary is padded from V to V' = ceil(V / p) * p; rank r holds rows
  [r V/p, (r+1) V/p) of the padded table; padding rows start at zero, are never
  looked up, their logits are filled with the dtype's minimum and the loss ignores
  them, so their gradient is exactly zero and they stay zero (no weight decay on 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from models.init import LocalSlice
from parallel.tp.comm import (
    _rank,
    _size,
    copy_to_tp,
    gather_from_sequence_parallel,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel,
    scatter_to_tp,
)

# ----------------------------------------------------------------------------- parameter marks


def _mark(
    param: nn.Parameter, sharded: bool, shard_dim: int | None = None, logical_size: int | None = None
) -> nn.Parameter:
    param.tp_sharded = sharded  # type: ignore[attr-defined]
    param.tp_shard_dim = shard_dim  # type: ignore[attr-defined]
    if logical_size is not None:  # the logical size along shard_dim, when not p x local (padded vocab)
        param.tp_logical_size = logical_size  # type: ignore[attr-defined]
    return param


def is_tp_sharded(param: Tensor) -> bool:
    """True if `param` holds a 1/p slice of a single-device parameter (else it is replicated over tp)."""
    return bool(getattr(param, "tp_sharded", False))


def is_sequence_parallel_param(param: Tensor) -> bool:
    """True if `param` is replicated but sees sequence-split activations (partial gradients)."""
    return bool(getattr(param, "sequence_parallel", False))


def tp_local_slice(param: Tensor, tp_size: int, tp_rank: int) -> LocalSlice:
    """Which part of its logical (single-device) tensor `param` holds on tp rank `tp_rank`.

    Sharded parameters hold the rank's equal 1/p chunk along `tp_shard_dim`; the
    vocab-parallel embedding's chunk of the padded vocabulary may hold fewer real rows
    (the rest is zero padding: `LocalSlice.size` > `length`). Replicated ones hold it whole.
    """
    shape = tuple(param.shape)
    if not is_tp_sharded(param):
        return LocalSlice.whole(shape)
    dim = int(param.tp_shard_dim)  # type: ignore[attr-defined]
    per = shape[dim]
    start = tp_rank * per
    logical = int(getattr(param, "tp_logical_size", per * tp_size))
    full = (*shape[:dim], logical, *shape[dim + 1 :])
    return LocalSlice(full, dim, start, max(0, min(per, logical - start)), per)


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
    # parallel.pipeline.zero_bubble defer the weight gradient of the local matmul alone.
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
        self.weight = _mark(nn.Parameter(local), True, 0, logical_size=self.num_embeddings)
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
