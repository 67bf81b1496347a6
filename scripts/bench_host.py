"""The CPU proxy of a micro-batch's host cost: eager, compiled and bucketed against today's eager.

    python scripts/bench_host.py --output outputs/bench      # part of `scripts/bench.py`'s CPU run
    python scripts/bench_host.py --repeats 5 --no_save       # a rehearsal

On a GPU a small micro-batch costs host time, not device time: each aten op the host
dispatches costs about 24 us there (issue 34: 3,900 ops, 94 ms per micro-batch of 1,024
tokens on an H100). Here the same host work is measured on a CPU, at a size where the
arithmetic is negligible: d_model 32, 2 + 2 layers, vocabulary 256, micro-batches of 4
pairs of 4-24 tokens, 16 micro-batches per flush through the executor
(`ParallelModel.train_step`: forward and backward, as the trainer runs them; no optimizer).

Variants, on the same weights and the same pairs:

    eager                     today's engine: lengths padded to the micro-batch's longest
    eager_bucketed            lengths padded to multiples of pad_to_multiple_of (8)
    compiled                  torch_compile: each layer compiled, dynamic shapes
    compiled_bucketed         both
    compiled_static_bucketed  one static graph per bucket (the alternative to dynamic shapes;
                              in a process of its own, with its own eager)

Per variant: host time per micro-batch (process CPU time: on a shared machine wall time
also counts other processes' turns; the arithmetic is negligible either way), as the
median over repeats of its ratio to eager in the same repeat, the variants alternating
within each repeat; aten ops and inductor kernels per micro-batch
(`parallel.dispatch_count`); graphs compiled in the first flush (warm-up) and after it
(recompiles), graph breaks; the loss and gradients against eager (fp32).

Writes OUTPUT/host_proxy.json and .md, and the latest in `benchmarks/host_proxy_cpu.*`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.config import ModelConfig  # noqa: E402
from models.m2m100 import M2M100Translation, Seq2SeqBatch  # noqa: E402
from parallel.compile import CompileCounts  # noqa: E402
from parallel.dispatch_count import DispatchCounter  # noqa: E402

VARIANTS = ("eager", "eager_bucketed", "compiled", "compiled_bucketed")
STATIC = "compiled_static_bucketed"
PAD = 8  # pad_to_multiple_of's default
M = 16  # micro-batches per flush
# issue 34, one H100: m=8 micro-batches of 4 x 256 (1,024 target tokens): 94 ms of host time
# and about 3,900 aten ops each (forward and backward), so ~24 us per op.
GPU_MS_PER_MICROBATCH, GPU_OPS_PER_MICROBATCH = 94.0, 3900


def model_config() -> ModelConfig:
    return ModelConfig(vocab_size=256, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=256)  # fmt: skip


def microbatches(cfg: ModelConfig, pad: int, seed: int = 0) -> list[Seq2SeqBatch]:
    """M micro-batches of 4 pairs with lengths uniform in [4, 24], padded to multiples of `pad`."""
    from trainer.data.batching import collate

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(M):
        src_len = torch.randint(4, 25, (4,), generator=g).tolist()
        tgt_len = torch.randint(4, 25, (4,), generator=g).tolist()
        src = [torch.randint(4, cfg.vocab_size, (n,), generator=g).tolist() for n in src_len]
        tgt = [torch.randint(4, cfg.vocab_size, (n,), generator=g).tolist() for n in tgt_len]
        out.append(collate(src, tgt, cfg.pad_token_id, cfg.decoder_start_token_id, pad))
    return out


def build(base: M2M100Translation, variant: str) -> Any:
    from parallel.mesh import ParallelDims, build_mesh
    from parallel.parallelize import build_parallel_model

    mesh = build_mesh(ParallelDims(pp=1, dp=1, tp=1, world_size=1), "cpu")
    model = copy.deepcopy(base)
    pm = build_parallel_model(model, mesh, [len(model.blocks)], M, "1f1b", 1, "none", 0.0)
    if variant.startswith("compiled"):
        from parallel.compile import apply_compile

        apply_compile(pm.model, dynamic=variant != STATIC)
    return pm


def flush(pm: Any, mbs: list[Seq2SeqBatch], scale: float) -> torch.Tensor:
    """Forward and backward of the M micro-batches; returns the loss sum (grads left in place)."""
    [res] = pm.train_step([mbs], scale)
    assert res.loss_sum is not None
    return res.loss_sum


def measure(variants: tuple[str, ...], repeats: int) -> dict[str, Any]:
    """One process: build every variant, warm up, then time them alternating."""
    from parallel.mesh import init_distributed

    init_distributed()
    cfg = model_config()
    base = M2M100Translation(cfg, seed=0)
    batches = {pad: microbatches(cfg, pad) for pad in (1, PAD)}
    scale = 1.0 / sum(b.num_tokens() for b in batches[1])
    rows: dict[str, dict[str, Any]] = {}
    pms, mbs_of = {}, {}
    for v in variants:
        pms[v], mbs_of[v] = build(base, v), batches[PAD if "bucketed" in v else 1]
        before, t0 = CompileCounts.now(), time.perf_counter()
        loss = flush(pms[v], mbs_of[v], scale)  # warm-up: every layer kind meets its first shape
        warm = CompileCounts.now() - before
        grads = [p.grad.clone() for p in pms[v].model.parameters()]
        pms[v].model.zero_grad(set_to_none=True)
        rows[v] = {"warmup_s": time.perf_counter() - t0, "graphs_warmup": warm.graphs,
                   "graph_breaks": warm.graph_breaks, "loss": float(loss), "_grads": grads}  # fmt: skip
    ref = rows["eager"]
    for v in variants:
        row = rows[v]
        row["loss_rel_diff_vs_eager"] = abs(row["loss"] - ref["loss"]) / abs(ref["loss"])
        row["grad_max_rel_diff_vs_eager"] = max(
            float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
            for g, r in zip(row["_grads"], ref["_grads"])
        )
    samples: dict[str, list[float]] = {v: [] for v in variants}
    later = {v: CompileCounts() for v in variants}
    for _ in range(repeats):
        for v in variants:
            before, c0 = CompileCounts.now(), time.process_time()
            flush(pms[v], mbs_of[v], scale)
            samples[v].append((time.process_time() - c0) / M)
            later[v] = later[v] + (CompileCounts.now() - before)
            pms[v].model.zero_grad(set_to_none=True)
    for v in variants:
        with DispatchCounter() as counter:
            flush(pms[v], mbs_of[v], scale)
        pms[v].model.zero_grad(set_to_none=True)
        row = rows[v]
        del row["_grads"]
        ratios = [a / b for a, b in zip(samples[v], samples["eager"])]
        positions = sum(b.size * (b.input_ids.shape[1] + b.labels.shape[1]) for b in mbs_of[v])
        real = sum(b.num_tokens() + b.num_src_tokens() for b in mbs_of[v])
        row.update(
            host_ms_per_microbatch=1e3 * statistics.median(samples[v]),
            host_time_vs_eager=statistics.median(ratios),
            aten_ops_per_microbatch=counter.num_ops / M,
            kernels_per_microbatch=counter.kernels / M,
            launches_per_microbatch=counter.launches / M,
            compiled_graph_calls_per_microbatch=counter.graph_calls / M,
            host_reads_per_microbatch=counter.host_reads / M,
            recompiles_after_warmup=later[v].graphs,
            padding_fraction=1 - real / positions,
            shapes=len({(b.size, b.input_ids.shape[1], b.labels.shape[1]) for b in mbs_of[v]}),
        )
    return rows


def gpu_shaped_launches() -> dict[str, float]:
    """Launches per micro-batch of the GPU benchmark's 418M case (12 + 12 layers, dropout 0.1, bf16
    autocast with working weights, 8 micro-batches of 4 full-length pairs) at a tiny width:
    op counts do not depend on the widths, so eager's count should be the GPU's ~3,900. Attention
    dropout is left out: CUDA's attention kernels draw it inside their one op, where a CPU falls
    back to the unfused math attention (1.5x the ops)."""
    from parallel.mesh import ParallelDims, build_mesh
    from parallel.parallelize import build_parallel_model

    cfg = ModelConfig(vocab_size=256, d_model=32, encoder_layers=12, decoder_layers=12, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.1,
                      attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=256)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, 256, (16,), generator=g).tolist() for _ in range(64)]
    from trainer.data.batching import collate

    mbs = [collate(rows[i : i + 4], rows[32 + i : 36 + i], cfg.pad_token_id, cfg.decoder_start_token_id)
           for i in range(0, 32, 4)]  # fmt: skip
    mesh = build_mesh(ParallelDims(pp=1, dp=1, tp=1, world_size=1), "cpu")
    out = {}
    for variant in ("eager", "compiled"):
        model = M2M100Translation(cfg, seed=0)
        pm = build_parallel_model(model, mesh, [len(model.blocks)], 8, "1f1b", 1, "none", 0.0,
                                  autocast_dtype=torch.bfloat16)  # fmt: skip
        if variant == "compiled":
            from parallel.compile import apply_compile

            apply_compile(pm.model)
        scale = 1.0 / sum(b.num_tokens() for b in mbs)
        pm.train_step([mbs], scale, dropout_keys=[list(range(8))])  # warm-up (compiles)
        pm.model.zero_grad(set_to_none=True)
        with DispatchCounter() as counter:
            pm.train_step([mbs], scale, dropout_keys=[list(range(8))])
        out[f"{variant}_aten_ops"] = counter.num_ops / 8
        out[f"{variant}_launches"] = counter.launches / 8
        out[f"{variant}_graph_calls"] = counter.graph_calls / 8
    return out


def region_overhead_us(repeats: int = 300) -> float:
    """Host cost of one compiled region's forward and backward beyond its work: a compiled
    `x * 2` (one kernel) against the eager op, per call, process CPU time (dynamo's guards,
    the AOT autograd runtime wrappers, the generated wrapper)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    compiled = torch.compile(f, dynamic=False)
    x = torch.randn(64, requires_grad=True)
    costs = {}
    for name, fn in (("eager", f), ("compiled", compiled)):
        for _ in range(5):
            fn(x).sum().backward()
        c0 = time.process_time()
        for _ in range(repeats):
            fn(x).sum().backward()
        costs[name] = (time.process_time() - c0) / repeats
    return 1e6 * (costs["compiled"] - costs["eager"])


def gpu_estimate(
    rows: dict[str, dict[str, Any]], shaped: dict[str, float], region_us: float
) -> dict[str, Any]:
    """What the CPU figures say about the GPU's host time per micro-batch (benchmarks/README.md):
    launches do not depend on the device, so the GPU-shaped eager count checks the proxy against
    the GPU's ~3,900; host cost per launch is the GPU's (94 ms / 3,900 = 24 us, issue 34), and each
    compiled region call (forward or backward) adds an overhead scaled from the CPU by the two
    hosts' cost per eager op: at least half the pure region overhead (a compiled `x * 2`), at most
    what a layer's call cost here beyond its launches (its kernels' CPU arithmetic included)."""
    eager, comp = rows["eager"], rows["compiled"]
    us_per_op_cpu = 1e3 * eager["host_ms_per_microbatch"] / eager["launches_per_microbatch"]
    us_per_op_gpu = 1e3 * GPU_MS_PER_MICROBATCH / GPU_OPS_PER_MICROBATCH
    beyond = 1e3 * comp["host_ms_per_microbatch"] - us_per_op_cpu * comp["launches_per_microbatch"]
    in_situ_us = beyond / comp["compiled_graph_calls_per_microbatch"]
    eager_ms = us_per_op_gpu * shaped["eager_launches"] / 1e3

    def compiled_ms(region_cpu_us: float) -> float:
        region_gpu = region_cpu_us * us_per_op_gpu / us_per_op_cpu  # per graph call
        return (
            us_per_op_gpu * shaped["compiled_launches"] + region_gpu * shaped["compiled_graph_calls"]
        ) / 1e3

    low, high = compiled_ms(region_us / 2), compiled_ms(in_situ_us)
    return {
        "us_per_op_cpu_eager": us_per_op_cpu,
        "us_per_op_gpu_eager": us_per_op_gpu,
        "region_overhead_us_cpu_fwd_bwd": region_us,
        "region_overhead_us_cpu_in_situ_per_call": in_situ_us,
        "gpu_shaped_eager_launches_per_microbatch": shaped["eager_launches"],
        "gpu_shaped_eager_launches_vs_gpu_measured": shaped["eager_launches"] / GPU_OPS_PER_MICROBATCH,
        "gpu_shaped_compiled_launches_per_microbatch": shaped["compiled_launches"],
        "gpu_shaped_compiled_graph_calls_per_microbatch": shaped["compiled_graph_calls"],
        "predicted_gpu_eager_ms_per_microbatch": eager_ms,
        "predicted_gpu_compiled_ms_per_microbatch_low": low,
        "predicted_gpu_compiled_ms_per_microbatch_high": high,
        "predicted_gpu_compiled_vs_eager_low": low / eager_ms,
        "predicted_gpu_compiled_vs_eager_high": high / eager_ms,
    }


def render(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        "# Host cost per micro-batch: the CPU proxy",
        "",
        f"Machine: {result['machine']}. `scripts/bench_host.py`, {result['repeats']} repeats, "
        f"{M} micro-batches per flush; wall time {result['wall_s']:.0f} s.",
        "",
        "| variant | host ms / mb | vs eager | aten ops / mb | kernels / mb | launches / mb | graph calls / mb "
        "| graphs warm-up | recompiles after | breaks | padding | shapes | loss rel diff | grad rel diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in rows.items():
        lines.append(
            f"| {v} | {r['host_ms_per_microbatch']:.2f} | {r['host_time_vs_eager']:.2f} "
            f"| {r['aten_ops_per_microbatch']:.0f} | {r['kernels_per_microbatch']:.0f} "
            f"| {r['launches_per_microbatch']:.0f} | {r['compiled_graph_calls_per_microbatch']:.0f} "
            f"| {r['graphs_warmup']} | {r['recompiles_after_warmup']} | {r['graph_breaks']} "
            f"| {r['padding_fraction']:.1%} | {r['shapes']} | {r['loss_rel_diff_vs_eager']:.1e} "
            f"| {r['grad_max_rel_diff_vs_eager']:.1e} |"
        )
    est = result["gpu_estimate"]
    lines += ["", "GPU estimate (see benchmarks/README.md):", "", "| key | value |", "|---|---|"]
    lines += [f"| `{k}` | {v:.3g} |" for k, v in est.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15, help="timed flushes per variant, alternating")
    ap.add_argument("--output", default="outputs/bench", help="writes host_proxy.json and .md here")
    ap.add_argument("--no_save", action="store_true", help="do not copy the results into benchmarks/")
    ap.add_argument(
        "--no_static", action="store_true", help="skip the static-graph variant (a second process)"
    )
    ap.add_argument("--variants", default="", help=argparse.SUPPRESS)  # the second process's
    ap.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.variants:  # a child: measure these, write JSON
        rows = measure(tuple(args.variants.split(",")), args.repeats)
        if "compiled" in rows:  # the first process: also what predicts the GPU
            rows["_gpu"] = {**gpu_shaped_launches(), "region_us": region_overhead_us()}
        Path(args.json).write_text(json.dumps(rows))
        return rows
    t0 = time.perf_counter()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    groups = [VARIANTS] + ([] if args.no_static else [("eager", STATIC)])
    for i, group in enumerate(groups):
        path = out / f"host_proxy_part{i}.json"
        cmd = [sys.executable, __file__, "--variants", ",".join(group), "--repeats", str(args.repeats),
               "--json", str(path)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        part = json.loads(path.read_text())
        rows.update({k: v for k, v in part.items() if k not in rows})
    gpu = rows.pop("_gpu")
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "repeats": args.repeats,
        "rows": rows,
        "gpu_estimate": gpu_estimate(rows, gpu, gpu["region_us"]),
        "wall_s": time.perf_counter() - t0,
    }
    (out / "host_proxy.json").write_text(json.dumps(result, indent=1))
    (out / "host_proxy.md").write_text(render(result))
    print(render(result))
    if not args.no_save:
        for suffix in ("json", "md"):
            (ROOT / "benchmarks" / f"host_proxy_cpu.{suffix}").write_text(
                (out / f"host_proxy.{suffix}").read_text()
            )
    return result


if __name__ == "__main__":
    main()
