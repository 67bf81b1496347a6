"""`scripts/bench_moe.py` still drives the real step: one alternating step of every side
(ours grouped / buffer / dropless, transformers' NllbMoe as shipped and with 4.57's forward)
on a tiny config, on a one-rank gloo group. Not a timing check: it keeps the benchmark
that backs the README's MoE speed row runnable (it had lost an interface `train_step` reads)."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path
from typing import Any

from tests.dist.harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _one_step_of_each_side(rank: int, world_size: int) -> dict[str, Any]:
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "scripts" / "bench_moe.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(experts=4, d_model=32, ffn=64, layers=2, vocab=300, steps=1, warmup=1, device="cpu")
    return bench.one_process(args, 4, 12)


def test_bench_moe_runs_every_side_one_step() -> None:
    (res,) = run_distributed(_one_step_of_each_side, 1, timeout=180)
    assert set(res["step_s"]) == {"ours", "ours_buffer", "ours_dropless", "hf", "hf_4_57"}
    assert all(t > 0 for t in res["step_s"].values())
    assert all(math.isfinite(r) and r > 0 for r in res["ratios"].values())
    assert res["config"]["num_experts"] == 4 and res["config"]["sparse_layers"]
