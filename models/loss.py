"""Token cross-entropy over a large vocabulary without fp32 (N, V) logits.

At V = 128k a micro-batch of 32 x 256 tokens has 4.2 GB of fp32 logits, and the
usual `F.cross_entropy(logits.float(), ...)` holds them, their log-softmax and
their gradient. Here the logits stay in the dtype the head produced them in (bf16
under mixed precision) and are read in chunks of rows that are upcast one at a
time: the forward keeps only log Z per token, and the backward writes the
gradient into the logits' own storage, chunk by chunk (nothing reads the logits
after the loss; Megatron's fused cross-entropy reuses them the same way).

    log p_j = z_j - log Z,      log Z = logsumexp_j z_j
    loss    = (1 - eps) (-log p_t) + eps mean_j (-log p_j)        (F.cross_entropy's smoothing)
    dL/dz_j = p_j - (1 - eps) [j = t] - eps / V

Legend: N tokens (B T), V vocabulary, eps label smoothing, t the target id.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 26  # fp32 elements upcast at a time (256 MiB)


def chunk_rows(vocab: int) -> int:
    """Rows per chunk so a chunk holds about `CHUNK_ELEMENTS` fp32 values."""
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a chunk is computed in: fp32, or fp64 for fp64 logits (reference runs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_loss(z: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """One chunk's (log Z, per-token loss) from its logits (n_c, V) in any float dtype."""
    z = z.to(_acc_dtype(z.dtype))
    lse = torch.logsumexp(z, dim=-1)
    nll = lse - z.gather(1, target[:, None]).squeeze(1)
    if eps > 0.0:
        nll = (1.0 - eps) * nll + eps * (lse - z.mean(dim=-1))
    return lse, nll


def _chunk_grad_(z: Tensor, target: Tensor, lse: Tensor, scale: Tensor, eps: float) -> None:
    """Overwrite one chunk's logits (n_c, V) with d(loss)/d(logits), `scale` per row."""
    p = torch.exp(z.to(lse.dtype) - lse[:, None])  # p_j
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == target[:, None]  # [j = t]
    grad = p - (1.0 - eps) * hit.to(lse.dtype) - eps / z.shape[1]
    z.copy_(grad * scale[:, None])


def _chunk_grad_eager_(z: Tensor, target: Tensor, lse: Tensor, scale: Tensor, eps: float) -> None:
    """`_chunk_grad_` in fewer passes for eager execution (CPU): in-place ops and a scatter
    instead of a one-hot comparison, which only pays when inductor fuses it away."""
    grad = (z.to(lse.dtype) - lse[:, None]).exp_()  # p_j
    grad.scatter_add_(1, target[:, None], torch.full_like(lse[:, None], eps - 1.0))
    if eps > 0.0:
        grad.sub_(eps / z.shape[1])
    z.copy_(grad.mul_(scale[:, None]))


_COMPILED: dict[str, Any] = {}


def _kernels(device: torch.device) -> tuple[Any, Any]:
    """The chunk functions; on CUDA compiled by inductor into one fused kernel each (an eager
    chunk makes about ten passes over its fp32 values, 20% of a 418M model's step).

    Dynamic rows from the first call, as the layers (`parallel.compile`): the last chunk's rows
    change with every micro-batch's token count, and `dynamic=None` compiled both functions
    again mid-run (4 graphs at step 15 of gpu_check.sh's 40-step tiny run on an H100)."""
    if device.type != "cuda":
        return _chunk_loss, _chunk_grad_eager_
    if not _COMPILED:
        _COMPILED["loss"] = torch.compile(_chunk_loss, dynamic=True)
        _COMPILED["grad"] = torch.compile(_chunk_grad_, dynamic=True)
    return _COMPILED["loss"], _COMPILED["grad"]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        n, vocab = logits.shape  # (N, V)
        valid = target != IGNORE_INDEX
        safe = target.masked_fill(~valid, 0)
        lse = torch.empty(n, dtype=_acc_dtype(logits.dtype), device=logits.device)
        per_token = torch.empty(n, dtype=lse.dtype, device=logits.device)
        chunk_loss, _ = _kernels(logits.device)
        rows = chunk_rows(vocab)
        for a in range(0, n, rows):
            lse[a : a + rows], per_token[a : a + rows] = chunk_loss(
                logits[a : a + rows], safe[a : a + rows], eps
            )
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.eps = eps
        return per_token.masked_fill(~valid, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits, safe, valid, lse = ctx.saved_tensors
        n, vocab = logits.shape
        scale = valid.to(lse.dtype) * grad_out  # (N,)
        _, chunk_grad_ = _kernels(logits.device)
        rows = chunk_rows(vocab)
        for a in range(0, n, rows):
            b = min(a + rows, n)
            chunk_grad_(logits[a:b], safe[a:b], lse[a:b], scale[a:b], ctx.eps)  # the logits become their grad
        return logits, None, None


def cross_entropy_sum(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Sum of (label-smoothed) token cross-entropies over non-ignored labels (an fp32 scalar).

    Equals `F.cross_entropy(logits.float(), labels, reduction="sum", label_smoothing=eps,
    ignore_index=-100)`, computed in fp32 chunks (see the module docstring). Summing here
    and dividing by the global batch's token count outside (a host number:
    `Seq2SeqBatch.num_tokens`) makes the loss independent of how the batch is split.

    Args:
        logits: (..., V) in any float dtype; its storage is reused for its gradient.
        labels: (...) target ids, -100 where no loss.
        label_smoothing: eps in [0, 1).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedCrossEntropy.apply(flat, labels.reshape(-1), float(label_smoothing))  # type: ignore[no-any-return]
