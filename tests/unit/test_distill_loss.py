"""Word-level distillation's loss (`parallel.distill.loss`) against a direct torch reference on the
full logits: `F.cross_entropy` + `F.kl_div` of the temperature-softened distributions, in fp64
(exact) and fp32, values and gradients, with ignored labels, label smoothing and T != 1.
The vocab-parallel form is checked on a gloo group in tests/dist/test_distill.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.distill.loss import DistillSettings, distillation_loss_sum


def reference(s, h, w, labels, cfg):
    """(loss, ce, kd) sums by the book, on full (N, V) logits (the teacher's in its head's dtype)."""
    t = (h @ w.T).to(s.dtype)
    valid = labels != -100
    ce = F.cross_entropy(s, labels, reduction="sum", label_smoothing=cfg.label_smoothing)
    T = cfg.temperature
    kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="none")
    kd = T * T * kl.sum(-1)[valid].sum()
    return (1 - cfg.alpha) * ce + cfg.alpha * kd, ce, kd


def inputs(dtype, n=37, v=53, hdim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = (3 * torch.randn(n, v, generator=g)).to(dtype)
    h = torch.randn(n, hdim, generator=g).to(dtype)
    w = torch.randn(v, hdim, generator=g).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return s, h, w, labels


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize(
    "cfg",
    [
        DistillSettings(0.5),
        DistillSettings(0.3, 2.0, 0.1),
        DistillSettings(1.0, 0.7),
        DistillSettings(0.0, 3.0),
    ],
    ids=["a.5", "a.3-T2-eps.1", "a1-T.7", "a0-T3"],
)
def test_distillation_loss_equals_the_reference(dtype, tol, cfg) -> None:
    s, h, w, labels = inputs(dtype)
    ref_s = s.clone().requires_grad_(True)
    want = reference(ref_s, h, w, labels, cfg)
    want[0].backward(torch.tensor(0.25, dtype=dtype))
    got_s = s.clone().requires_grad_(True)
    logits = got_s * 1.0  # a non-leaf, as the head's output: its storage becomes the gradient
    got = distillation_loss_sum(logits, h, w, labels, cfg)
    got[0].backward(torch.tensor(0.25, dtype=dtype))
    for a, b in zip(got, want):
        assert a.dtype == dtype
        assert torch.allclose(a, b.detach(), rtol=tol, atol=tol), (a, b)
    assert not got[1].requires_grad and not got[2].requires_grad
    assert torch.allclose(got_s.grad, ref_s.grad, rtol=tol, atol=tol * 0.1)


def test_bf16_logits_in_fp32_chunks() -> None:
    """bf16 student logits and teacher (hidden, head): computed in fp32 chunks, as close to the
    fp32 reference on the bf16 values as bf16 gradient storage allows."""
    s, h, w, labels = inputs(torch.float32)
    cfg = DistillSettings(0.5, 2.0)
    sb, hb, wb = s.bfloat16(), h.bfloat16(), w.bfloat16()
    want = reference(sb.float().requires_grad_(True), hb, wb, labels, cfg)  # bf16 teacher logits
    leaf = sb.clone().requires_grad_(True)
    got = distillation_loss_sum(leaf * 1.0, hb, wb, labels, cfg)
    got[0].backward()
    assert got[0].dtype == torch.float32
    assert torch.allclose(got[0], want[0].detach(), rtol=1e-5)
    assert leaf.grad is not None and leaf.grad.dtype == torch.bfloat16


def test_no_grad_leaves_the_logits_alone() -> None:
    s, h, w, labels = inputs(torch.float32)
    before = s.clone()
    with torch.no_grad():
        distillation_loss_sum(s, h, w, labels, DistillSettings(0.5))
    assert torch.equal(s, before)


def test_misfit_teacher_is_refused() -> None:
    s, h, w, labels = inputs(torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        distillation_loss_sum(s, h[:-1], w, labels, DistillSettings(0.5))
