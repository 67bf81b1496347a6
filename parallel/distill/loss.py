"""Word-level distillation's loss, from the student's (vocab-parallel) logits and the teacher's final
hidden states, in chunks of rows: no (N, V) tensor but the student's logits is ever held.

Hinton et al. (2015), as word-level KD for translation (Kim & Rush, 2016). Per target token i
(a label that is not -100), with student logits s, teacher logits t = h W^T made here from the
teacher's final hidden state h (after `decoder.layer_norm`) and its head W (the tied embedding),
temperature T, label smoothing eps and weight alpha:

    q = softmax(s),  q^T = softmax(s / T),  p^T = softmax(t / T)
    ce_i = (1 - eps) (lse(s) - s_y) + eps (lse(s) - mean_j s_j)            (F.cross_entropy's)
    kd_i = T^2 KL(p^T || q^T) = T^2 [ sum_j p^T_j (t_j - s_j) / T - lse(t / T) + lse(s / T) ]
    loss = sum_i (1 - alpha) ce_i + alpha kd_i
    d loss / d s_j = (1 - alpha) [q_j - (1 - eps) [j = y] - eps / V] + alpha T (q^T_j - p^T_j)

With the shifted logits s' = s - max s, t' = t - max t (max over the real vocabulary) and
Z_1 = sum e^{s'}, Z_s = sum e^{s'/T}, Z_t = sum e^{t'/T}, A = sum e^{t'/T} (t' - s'):

    ce_i = log Z_1 - s'_y (+ smoothing),   kd_i = T^2 [A / (T Z_t) + log Z_s - log Z_t]

Vocab-parallel (Megatron's cross-entropy, extended): each tp rank holds the same V/p columns of s
and of W, so per chunk of rows one MAX all-reduce of (2, n) (the maxima of s and t) and one SUM
all-reduce of (6, n) (Z_1, Z_s, Z_t, A, s'_y, sum s') give every term; nothing of size V crosses.
Padded columns (ids >= V) take no part: masked out of every sum, their gradient exactly 0.

The gradient depends on nothing but the scalar the backward brings (the step's 1 / tokens), so it
is formed in the forward, chunk by chunk, into the student logits' own storage (nothing reads the
logits after the loss: `models.loss` reuses it the same way, in its backward), and the backward
scales it in place. So the teacher's logits are made once per chunk, one (n, H) x (H, V/p) product
(the product its own head would have run), and never stored: the teacher's contribution to memory
is its hidden states, (N, H) per micro-batch, instead of (N, V/p) logits. A chunk holds four
(n, V/p) fp32 buffers (student, teacher, two exponentials): about 512 MiB at the default size.

Legend: N tokens (B T), V vocabulary (V' padded to a multiple of p), p tp size, H teacher d_model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from models.loss import IGNORE_INDEX, chunk_rows
from parallel.tp.comm import _all_reduce


@dataclass(frozen=True)
class DistillSettings:
    """The loss's constants: alpha (the KD term's weight), the temperature T and label smoothing."""

    alpha: float
    temperature: float = 1.0
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class VocabSlice:
    """This rank's columns of the (padded) vocabulary: [start, start + local) of V real ids."""

    group: ProcessGroup | None  # the tp group; None: one rank holds the whole vocabulary
    start: int
    vocab_size: int


@dataclass(frozen=True)
class _Rows:
    """Per-row facts of a chunk: the label's local column (0 where not this rank's), whether it
    is one of this rank's columns, and whether the row carries a loss at all."""

    target: Tensor  # (n,) long
    mine: Tensor  # (n,) bool
    valid: Tensor  # (n,) bool

    def __getitem__(self, rows: slice) -> _Rows:
        return _Rows(self.target[rows], self.mine[rows], self.valid[rows])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (reference runs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce(x: Tensor, group: ProcessGroup | None, op: dist.ReduceOp.RedOpType) -> Tensor:
    return x if group is None else _all_reduce(x, group, op)


def _chunk(
    s_raw: Tensor,  # (n, V/p) student logits, any float dtype; overwritten with d loss / d s
    h: Tensor,  # (n, H) teacher hidden states
    w: Tensor,  # (V/p, H) teacher head shard
    rows: _Rows,
    real: Tensor,  # (V/p,) columns of the real vocabulary
    cfg: DistillSettings,
    vocab: VocabSlice,
    write_grad: bool,
) -> tuple[Tensor, Tensor]:
    """(ce, kd) per row of one chunk (module docstring); with `write_grad` the chunk's
    d loss / d s (per unit of the backward's scalar) replaces the logits in `s_raw`."""
    acc = _acc_dtype(s_raw.dtype)
    temp, eps, alpha = cfg.temperature, cfg.label_smoothing, cfg.alpha
    s = s_raw.to(acc, copy=True)  # (n, V/p)
    t = F.linear(h.to(w.dtype), w).to(acc)  # the teacher's logits, as its own head makes them
    neg = float("-inf")
    maxima = torch.stack([s.masked_fill(~real, neg).amax(-1), t.masked_fill(~real, neg).amax(-1)])
    maxima = _reduce(maxima, vocab.group, dist.ReduceOp.MAX)  # (2, n)
    s.sub_(maxima[0, :, None]).masked_fill_(~real, neg)  # s'
    t.sub_(maxima[1, :, None]).masked_fill_(~real, neg)  # t'
    p_t = torch.div(t, temp).exp_()  # e^{t'/T}
    picked = s.gather(1, rows.target[:, None]).squeeze(1).masked_fill(~rows.mine, 0.0)  # s'_y
    smooth = s.masked_fill(~real, 0.0).sum(-1) if eps > 0.0 else torch.zeros_like(picked)
    cross = t.sub_(s).masked_fill_(~real, 0.0).mul_(p_t).sum(-1)  # A = sum e^{t'/T} (t' - s')
    e_s = torch.div(s, temp, out=t).exp_() if temp != 1.0 else None  # e^{s'/T}, in t's storage
    e_1 = s.exp_()  # e^{s'}
    e_s = e_1 if e_s is None else e_s
    sums = torch.stack([e_1.sum(-1), e_s.sum(-1), p_t.sum(-1), cross, picked, smooth])
    z_1, z_s, z_t, cross, picked, smooth = _reduce(sums, vocab.group, dist.ReduceOp.SUM)  # (6, n)
    ce = z_1.log() - picked
    if eps > 0.0:
        ce = (1.0 - eps) * ce + eps * (z_1.log() - smooth / vocab.vocab_size)
    kd = temp * temp * (cross / (temp * z_t) + z_s.log() - z_t.log())
    if write_grad:
        q = e_1.div_(z_1[:, None])  # softmax(s)
        q_t = q if e_s is e_1 else e_s.div_(z_s[:, None])  # softmax(s / T)
        g = p_t.div_(z_t[:, None]).mul_(-alpha * temp)  # - alpha T p^T, in p_t's storage
        g.add_(q_t, alpha=alpha * temp).add_(q, alpha=1.0 - alpha)
        hit = ((eps - 1.0) * (1.0 - alpha) * rows.mine.to(acc))[:, None]  # - (1 - alpha)(1 - eps) [j = y]
        g.scatter_add_(1, rows.target[:, None], hit)
        if eps > 0.0:
            g.sub_(((1.0 - alpha) * eps / vocab.vocab_size) * real.to(acc))
        s_raw.copy_(g.mul_(rows.valid.to(acc)[:, None]))
    return ce, kd


class _DistillationLoss(torch.autograd.Function):
    """(loss sum, ce sum, kd sum) of the module docstring; only the first is differentiable."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,  # (N, V/p)
        hidden: Tensor,  # (N, H)
        weight: Tensor,  # (V/p, H)
        labels: Tensor,  # (N,)
        cfg: DistillSettings,
        vocab: VocabSlice,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n, n_local = logits.shape
        real = (torch.arange(n_local, device=logits.device) + vocab.start) < vocab.vocab_size  # (V/p,)
        valid = labels != IGNORE_INDEX
        local = labels - vocab.start
        mine = valid & (local >= 0) & (local < n_local)
        rows = _Rows(local.masked_fill(~mine, 0), mine, valid)
        acc = _acc_dtype(logits.dtype)
        ce = torch.zeros(n, dtype=acc, device=logits.device)
        kd = torch.zeros_like(ce)
        write = bool(ctx.needs_input_grad[0])
        step = max(1, chunk_rows(n_local) // 2)  # four fp32 (n, V/p) buffers per chunk
        for a in range(0, n, step):
            b = min(a + step, n)
            ce[a:b], kd[a:b] = _chunk(logits[a:b], hidden[a:b], weight, rows[a:b], real, cfg, vocab, write)
        ce_sum, kd_sum = ce.masked_fill(~valid, 0.0).sum(), kd.masked_fill(~valid, 0.0).sum()
        if write:
            ctx.save_for_backward(logits)  # holds d loss / d logits now
        ctx.mark_non_differentiable(ce_sum, kd_sum)
        return (1.0 - cfg.alpha) * ce_sum + cfg.alpha * kd_sum, ce_sum, kd_sum

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (logits,) = ctx.saved_tensors
        return logits.mul_(grad.to(logits.dtype)), None, None, None, None, None


def distillation_loss_sum(
    logits: Tensor,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    cfg: DistillSettings,
    vocab: VocabSlice | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The loss sum (1 - alpha) CE + alpha T^2 KL over non-ignored labels, and its two sums apart.

    Equals, on the full logits, `(1 - alpha) F.cross_entropy(s, y, reduction="sum",
    label_smoothing=eps) + alpha T^2 F.kl_div(log_softmax(s / T), log_softmax(t / T),
    log_target=True, reduction="sum")` over the rows whose label is not -100, with
    t = hidden @ weight^T (module docstring). Like `models.loss.cross_entropy_sum` it is a sum:
    the caller divides by the global batch's token count (a host number).

    Args:
        logits: (..., V/p) the student's logits (this rank's columns); their storage is reused
            for their gradient, so nothing may read them after this call.
        hidden: (..., H) the teacher's final hidden states for the same tokens, in the dtype its
            head multiplies in (bf16 under bf16: what autocast would have fed it).
        weight: (V/p, H) the teacher's head (its tied embedding) for the same columns.
        labels: (...) target ids, -100 where no loss.
        cfg: alpha, temperature, label smoothing.
        vocab: this rank's columns and the tp group; None: one rank holds all V columns.

    Returns:
        (loss sum, CE sum, KD sum): scalars in fp32 (fp64 for fp64 logits), identical on every tp
        rank; only the first carries a gradient.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.shape[0] != flat.shape[0] or weight.shape[0] != flat.shape[1]:
        raise ValueError(
            f"teacher hidden {tuple(hidden.shape)} and head {tuple(weight.shape)} do not fit the student's "
            f"logits {tuple(logits.shape)}: the same tokens and vocabulary columns are needed"
        )
    if vocab is None:
        vocab = VocabSlice(None, 0, flat.shape[1])
    return _DistillationLoss.apply(flat, h, weight, labels.reshape(-1), cfg, vocab)  # type: ignore[no-any-return]
