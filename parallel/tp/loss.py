"""Vocab-parallel cross-entropy and the logit gather, from (B, T, V/p) logit shards.

Owns the loss on vocab-sharded logits (Megatron's `_VocabParallelCrossEntropy`:
three all-reduces of (N,) vectors, never a gather of the (N, V) logits) and
`gather_logits` for evaluation and generation. The padding entries of V' (ids >= V)
take no part: `VocabParallelLMHead` fills their logits with the dtype's minimum and
the loss masks them, so their gradient is exactly zero.

Legend: p = tp size, N = B T tokens, V real vocabulary, V' = V padded to a multiple
of p, V/p = V' / p entries per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from models.m2m100 import IGNORE_INDEX
from parallel.tp.comm import _all_reduce, gather_from_tp


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
