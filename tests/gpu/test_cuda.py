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
