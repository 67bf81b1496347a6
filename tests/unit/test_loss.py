"""The chunked cross-entropy equals `F.cross_entropy` (values and gradients), chunk size aside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import loss as loss_mod
from models.loss import IGNORE_INDEX, cross_entropy_sum


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 7, 53, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 53, (3, 7), generator=g)
    labels[0, 4:] = IGNORE_INDEX
    labels[2, 1] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("chunk_elements", [53 * 4, 1 << 26])  # several chunks, one chunk
def test_matches_f_cross_entropy_fp32(eps: float, chunk_elements: int, monkeypatch) -> None:
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", chunk_elements)
    logits, labels = _inputs(torch.float32)
    ref_in = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(
        ref_in.reshape(-1, 53),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=eps,
    )
    (ref * 0.7).backward()
    got_in = logits.clone().requires_grad_(True)
    got = cross_entropy_sum(got_in * 1.0, labels, eps)  # through a non-leaf, as the head's output is
    (got * 0.7).backward()
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-5)
    assert torch.allclose(got_in.grad, ref_in.grad, rtol=1e-5, atol=1e-7)


def test_bf16_logits_are_read_in_fp32() -> None:
    """bf16 logits: the loss is F.cross_entropy of their fp32 upcast (no bf16 log-softmax)."""
    logits, labels = _inputs(torch.bfloat16, seed=1)
    ref = F.cross_entropy(
        logits.float().reshape(-1, 53), labels.reshape(-1), reduction="sum", label_smoothing=0.1
    )
    got = cross_entropy_sum(logits.clone(), labels, 0.1)
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-6)


def test_fp64_logits_are_computed_in_fp64() -> None:
    """Reference runs in fp64 (the benchmarks' ground truth) must not round through fp32."""
    logits, labels = _inputs(torch.float64, seed=2)
    ref = F.cross_entropy(logits.reshape(-1, 53), labels.reshape(-1), reduction="sum", label_smoothing=0.1)
    got = cross_entropy_sum(logits.clone(), labels, 0.1)
    assert got.dtype == torch.float64
    assert torch.allclose(got, ref, rtol=1e-12)
