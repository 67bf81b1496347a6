"""GPU checks (skipped without CUDA): SDPA/flash attention in bf16, and NCCL collectives.

CI has no GPU; these run on a CUDA machine with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from models.m2m100 import M2M100Translation
from tests.dist.pipeline_workers import TINY, random_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_autocast_loss_close_to_fp32() -> None:
    cfg = ModelConfig(**{**TINY, "d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128})
    torch.manual_seed(0)
    model = M2M100Translation(cfg).cuda().eval()
    batch = random_batch(cfg, 8, seed=0).to("cuda")
    with torch.no_grad():
        fp32 = model.loss(batch)[0].item()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = model.loss(batch)[0].item()
    assert abs(bf16 - fp32) / fp32 < 2e-2


def test_nccl_single_rank_all_reduce() -> None:
    import torch.distributed as dist

    from parallel.mesh import init_distributed

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    init_distributed(backend="nccl", timeout_s=60)
    try:
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        assert t.sum().item() == 4
    finally:
        dist.destroy_process_group()


def _one_rank_model(bf16: bool, schedule: str = "1f1b", m: int = 2) -> tuple:
    import torch.distributed as dist

    from parallel.mesh import ParallelDims, build_mesh, init_distributed
    from parallel.parallelize import build_parallel_model

    if not dist.is_initialized():
        init_distributed(backend="nccl", timeout_s=60)
    cfg = ModelConfig(**{**TINY, "d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128})
    torch.manual_seed(0)
    model = M2M100Translation(cfg).cuda()
    mesh = build_mesh(ParallelDims(pp=1, dp=1, tp=1, world_size=1), "cuda")
    pm = build_parallel_model(
        model, mesh, [len(model.blocks)], m, schedule, 1, "none", 0.0,
        autocast_dtype=torch.bfloat16 if bf16 else None,
    )  # fmt: skip
    return cfg, pm


def test_bf16_step_fused_adamw_no_sync_and_event_timing() -> None:
    """On CUDA: fused AdamW, no synchronisation inside the flushes and the clip, and a timeline
    from CUDA events whose busy time is device time (positive, within the flush's span)."""
    from parallel.pipeline.timing import DeviceClock
    from trainer.config.training_args import TrainingArguments
    from trainer.run.step import build_optimizer

    cfg, pm = _one_rank_model(bf16=True)
    opt = build_optimizer(pm.model, TrainingArguments(output_dir="/tmp/gpu_test"))
    assert opt.defaults["fused"] is True
    batch = random_batch(cfg, 8, seed=0)
    flushes = [batch.split(2), batch.split(2)]
    pm.train_step(flushes, 1.0 / batch.num_tokens())  # warm-up (allocations, cuDNN plans)
    pm.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        results = pm.train_step(flushes, 1.0 / batch.num_tokens(), timed=True)
        norm = pm.grads.clip_(1.0)
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert isinstance(pm.clock, DeviceClock)
    last = results[-1]
    assert last.timeline and 0 < last.busy_s <= last.wall_s
    assert torch.isfinite(norm).item()
    assert last.peak_activation_bytes > 0  # the allocator meter saw the forwards' activations


def test_bf16_loss_tracks_fp32_over_steps() -> None:
    """Ten AdamW steps on one batch: the bf16 losses stay within 3% of the fp32 ones."""
    from trainer.config.training_args import TrainingArguments
    from trainer.run.step import build_optimizer

    losses = {}
    for bf16 in (False, True):
        cfg, pm = _one_rank_model(bf16=bf16)
        opt = build_optimizer(pm.model, TrainingArguments(output_dir="/tmp/gpu_test", learning_rate=1e-3))
        batch = random_batch(cfg, 8, seed=0)
        out = []
        for _ in range(10):
            res = pm.train_step([batch.split(2)], 1.0 / batch.num_tokens())
            pm.grads.clip_(1.0)
            opt.step()
            pm.model.zero_grad(set_to_none=True)
            out.append(float(sum(r.loss_sum for r in res)) / batch.num_tokens())
        losses[bf16] = out
    for a, b in zip(losses[False], losses[True]):
        assert abs(a - b) / a < 0.03, (losses[False], losses[True])


def test_chunked_cross_entropy_on_cuda_matches_f_cross_entropy() -> None:
    """The compiled chunk kernels (bf16 logits, several chunks) against F.cross_entropy in fp32."""
    import torch.nn.functional as F

    from models.loss import chunk_rows, cross_entropy_sum

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab = 50_000
    n = 3 * chunk_rows(vocab) + 17  # several full chunks and a partial one
    logits = (torch.randn(n, vocab, device="cuda", generator=g) * 2).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::7] = -100
    for eps in (0.0, 0.1):
        ref_in = logits.float().requires_grad_(True)
        ref = F.cross_entropy(ref_in, labels, reduction="sum", label_smoothing=eps)
        ref.backward()
        got_in = logits.clone().requires_grad_(True)
        got = cross_entropy_sum(got_in * 1, labels, eps)
        got.backward()
        assert abs(got.item() - ref.item()) / ref.item() < 1e-5
        err = (got_in.grad.float() - ref_in.grad).abs().max().item()
        assert err < 1e-2 * ref_in.grad.abs().max().item(), err  # bf16 gradient storage
