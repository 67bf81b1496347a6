"""The GPU paths a CPU never runs (skipped without CUDA; `scripts/gpu_check.sh` runs them):
NLLB-MoE in bf16 on `torch._grouped_mm`, fp16 with the dynamic loss scale, compiled steps,
and the trainer with async saves and streaming data workers.

`pytest -m gpu tests/gpu` on a CUDA machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.m2m100 import M2M100Translation
from tests.dist.pipeline_workers import TINY, random_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]
WIDE = {**TINY, "d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128}  # 16-byte-aligned bf16 rows


def _pm(cfg: ModelConfig, dtype: torch.dtype | None, m: int = 2, compile_layers: bool = False):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from parallel.mesh import ParallelDims, build_mesh, init_distributed
    from parallel.parallelize import build_parallel_model

    if not dist.is_initialized():
        init_distributed(backend="nccl", timeout_s=60)
    torch.manual_seed(0)
    model = M2M100Translation(cfg).cuda()
    mesh = build_mesh(ParallelDims(pp=1, dp=1, tp=1, world_size=1), "cuda")
    return build_parallel_model(model, mesh, [len(model.blocks)], m, "1f1b", 1, "none", 0.0,
                                autocast_dtype=dtype, compile_layers=compile_layers)  # fmt: skip


def _losses(pm, batch, steps: int, scale=None) -> list[float]:  # type: ignore[no-untyped-def]
    """Plain SGD-free steps: forward + backward of the same batch, zeroing grads (losses only)."""
    out = []
    for _ in range(steps):
        s = 1.0 / batch.num_tokens() if scale is None else scale.scale / batch.num_tokens()
        res = pm.train_step([batch.split(2)], s)
        out.append(float(sum(r.loss_sum for r in res)) / batch.num_tokens())
        pm.model.zero_grad(set_to_none=True)
    return out


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0), reason="_grouped_mm: sm90+"
)
def test_bf16_nllb_moe_step_on_grouped_mm() -> None:
    """An NLLB-MoE step in bf16 routes its experts' rows through `torch._grouped_mm` (sm90+), and
    its loss tracks fp32's within 3%, gradients finite on every expert."""
    from models.moe.experts import grouped_layout

    cfg = ModelConfig(**{**WIDE, "num_experts": 4, "encoder_sparse_step": 2, "decoder_sparse_step": 2,
                         "moe_token_dropout": 0.0})  # fmt: skip
    batch = random_batch(cfg, 8, seed=0)
    fp32 = _losses(_pm(cfg, None), batch, 1)[0]
    pm = _pm(cfg, torch.bfloat16)
    experts = next(iter(pm.model.sparse_ffns().values())).experts
    assert grouped_layout(torch.zeros(2, cfg.d_model, device="cuda", dtype=torch.bfloat16), experts)
    res = pm.train_step([batch.split(2)], 1.0 / batch.num_tokens())
    bf16 = float(sum(r.loss_sum for r in res)) / batch.num_tokens()
    assert abs(bf16 - fp32) / fp32 < 0.03, (bf16, fp32)
    grads = [p.grad for n, p in pm.model.named_parameters() if "experts" in n]
    assert grads and all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


def test_fp16_steps_with_the_loss_scale() -> None:
    """fp16 working weights with the dynamic loss scale on the device: the unscaled gradients are
    finite at S = 2**16 and overflow is found at S = 2**60 (then S backs off), the loss tracks fp32."""
    from parallel.loss_scale import DynamicLossScale

    cfg = ModelConfig(**WIDE)
    batch = random_batch(cfg, 8, seed=0)
    fp32 = _losses(_pm(cfg, None), batch, 1)[0]
    pm = _pm(cfg, torch.float16)
    found = []
    for init in (2.0**16, 2.0**60):
        scaler = DynamicLossScale(pm.device, init_scale=init)
        res = pm.train_step([batch.split(2)], scaler.scale / batch.num_tokens())
        inf = scaler.unscale_(p.grad for p in pm.params())
        scaler.update(inf)
        found.append((float(inf), float(scaler.scale)))
        if init == 2.0**16:
            fp16 = float(sum(r.loss_sum for r in res)) / batch.num_tokens()
        pm.model.zero_grad(set_to_none=True)
    assert found[0] == (0.0, 2.0**16) and found[1] == (1.0, 2.0**59), found
    assert abs(fp16 - fp32) / fp32 < 0.03, (fp16, fp32)


def test_compiled_step_equals_eager_without_recompiles() -> None:
    """torch_compile on CUDA (bf16): the compiled layers give eager's losses (bf16 tolerance), and
    micro-batches of new lengths after the first step compile nothing."""
    from parallel.compile import CompileCounts

    cfg = ModelConfig(**WIDE)
    batches = [random_batch(cfg, 8, seed=s) for s in range(4)]  # lengths differ from batch to batch
    eager, compiled = _pm(cfg, torch.bfloat16), _pm(cfg, torch.bfloat16, compile_layers=True)
    first = None
    for i, batch in enumerate(batches):
        losses = [_losses(pm, batch, 1)[0] for pm in (eager, compiled)]
        assert abs(losses[1] - losses[0]) / losses[0] < 1e-2, (i, losses)
        if i == 0:
            first = CompileCounts.now()
    assert first is not None and (CompileCounts.now() - first).graphs == 0


def test_async_saves_and_streaming_workers_through_the_trainer(tmp_path: Path) -> None:
    """trainer.train on CUDA in bf16, streaming sharded JSON lines with 2 data workers per rank
    (started after CUDA is initialised), checkpoints written in the background: both commit."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "tests.dist.doc_fixtures", "jsonl", str(data), "en", "de", "fr"],
                   check=True, cwd=ROOT)  # fmt: skip
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.train", "--config", "configs/tiny.yaml", "--dataset_name", "null",
           "--train_file", str(data / "train.jsonl"), "--streaming", "true", "--dataloader_num_workers", "2",
           "--bf16", "true", "--max_steps", "4", "--save_steps", "2", "--async_save", "true", "--do_eval", "false",
           "--output_dir", str(out), "--report_to", "none"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=240)
    for step in (2, 4):
        assert (out / f"checkpoint-{step}" / "COMMITTED").is_file()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 4 and summary["data_time_share"] < 0.5
