"""Vocab-parallel cross-entropy and the logit gather, from (B, T, V/p) logit shards.

Owns the loss on vocab-sharded logits (Megatron's `_VocabParallelCrossEntropy`:
two all-reduces of (N,)-sized vectors, never a gather of the (N, V) logits, and no
fp32 copy of them either) and
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

from models.loss import chunk_rows
from models.m2m100 import IGNORE_INDEX
from parallel.tp.comm import _all_reduce, gather_from_tp


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum of label-smoothed token losses from vocab-sharded logits (Megatron's
    `_VocabParallelCrossEntropy`), with two all-reduces of (N,) vectors and no gather
    of the (N, V) logits:

        m = max_j z_j,   Z = sum_j exp(z_j - m),   log p_j = z_j - m - log Z
        loss = (1 - eps) (-log p_t) + eps * mean_{j < V} (-log p_j)
        d loss / d z_j = p_j - (1 - eps) [j = t] - eps / V [j < V]

    As in `models.loss`, the logits stay in their dtype and are upcast a chunk of rows
    at a time (no fp32 (N, V/p) tensor is held), and the backward writes the gradient
    into the logits' storage. The max is reduced first; Z, z_t - m and (for
    smoothing) sum_j (z_j - m) travel together in one (3, N) all-reduce.
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
        n, n_local = logits.shape
        real = (torch.arange(n_local, device=logits.device) + vocab_start) < vocab_size  # (V/p,)
        valid = target != ignore_index
        local_t = target - vocab_start
        mine = valid & (local_t >= 0) & (local_t < n_local)
        local_t = local_t.masked_fill(~mine, 0)
        rows = chunk_rows(n_local)
        m = torch.empty(n, dtype=torch.float32, device=logits.device)
        for a in range(0, n, rows):
            m[a : a + rows] = logits[a : a + rows].float().masked_fill(~real, float("-inf")).amax(dim=-1)
        m = _all_reduce(m, group, dist.ReduceOp.MAX)
        sums = torch.empty(3, n, dtype=torch.float32, device=logits.device)  # Z, z_t - m, sum (z - m)
        for a in range(0, n, rows):
            shifted = logits[a : a + rows].float() - m[a : a + rows, None]  # (n_c, V/p)
            sums[0, a : a + rows] = shifted.exp().masked_fill(~real, 0.0).sum(dim=-1)
            picked = shifted.gather(-1, local_t[a : a + rows, None]).squeeze(-1)
            sums[1, a : a + rows] = picked.masked_fill(~mine[a : a + rows], 0.0)
            sums[2, a : a + rows] = shifted.masked_fill(~real, 0.0).sum(dim=-1) if eps > 0.0 else 0.0
        sums = _all_reduce(sums, group)
        log_z = sums[0].log()
        loss = log_z - sums[1]  # -log p_t
        if eps > 0.0:
            loss = (1.0 - eps) * loss + eps * (log_z - sums[2] / vocab_size)
        ctx.save_for_backward(logits, m + log_z, local_t, mine, valid, real)
        ctx.eps, ctx.vocab_size = eps, vocab_size
        return loss.masked_fill(~valid, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits, lse, local_t, mine, valid, real = ctx.saved_tensors
        eps, vocab_size = ctx.eps, ctx.vocab_size
        n, n_local = logits.shape
        scale = valid.float() * grad_out  # (N,)
        rows = chunk_rows(n_local)
        for a in range(0, n, rows):
            b = min(a + rows, n)
            grad = torch.exp(logits[a:b].float() - lse[a:b, None]).masked_fill(~real, 0.0)  # p_j
            grad.scatter_add_(1, local_t[a:b, None], (eps - 1.0) * mine[a:b, None].float())
            if eps > 0.0:
                grad -= (eps / vocab_size) * real.float()
            grad *= scale[a:b, None]
            logits[a:b] = grad  # the logits' storage becomes their gradient
        return logits, None, None, None, None, None, None


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

    Same convention as `models.loss.cross_entropy_sum` (and `F.cross_entropy(...,
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
