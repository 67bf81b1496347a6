"""Benchmark: our explicit-autograd tensor parallelism vs PyTorch DTensor `parallelize_module`.

    python scripts/bench_tp.py [--iters 10 --warmup 2 --d_model 512 ...]   (spawns 2 gloo ranks)

Answers the tensor-parallel issue's question "DTensor or explicit autograd
functions?" with step times of the *same* `M2M100Translation` (same seed, same
batch, fp32, dropout off) on 2 CPU gloo ranks, `torch.set_num_threads(1)` per rank:

    (a) single       tp=1: the unmodified single-device model, run on each rank
    (b) ours         tp=2: `parallel.tp.apply.apply_tensor_parallel` (explicit
                     autograd f/g operators, vocab-parallel tied embedding + head,
                     vocab-parallel cross-entropy via `info.loss`)
    (c) dtensor      tp=2: `parallelize_module` on a deep copy of the single-device
                     model: q/k/v/fc1 ColwiseParallel, out_proj/fc2 RowwiseParallel,
                     the tied `shared` embedding RowwiseParallel(input_layouts=Replicate())
                     (vocab-sharded), and `lm_head` a PrepareModuleInput that makes its
                     (h, weight) inputs (Replicate, Shard(0)) DTensors so
                     F.linear(h, shared.weight) yields Shard(-1) logits; the unchanged
                     `model.loss` (F.cross_entropy, reduction="sum") under `loss_parallel()`.

A step is zero_grad + forward + loss (token sum / tokens) + backward (no optimizer).
Before timing, (b) and (c) are checked against (a): loss and every parameter
gradient (gathered to single-device shapes), max abs diff printed.
Variants are interleaved step by step (order rotated every round, a barrier before
each step); a step's time is the max over ranks; figures are medians over rounds,
and "ratio vs ours" is the median of the per-round ratios (noise-robust on a shared
machine). Results go to benchmarks/tp_cpu.md and benchmarks/tp_cpu.json.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.config import ModelConfig  # noqa: E402
from models.m2m100 import Attention, M2M100Translation, Seq2SeqBatch  # noqa: E402
from parallel.tp.apply import apply_tensor_parallel, gather_full_state_dict  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402

VARIANTS = ("single", "ours", "dtensor")
LABELS = {
    "single": "(a) single device, tp=1",
    "ours": "(b) ours: apply_tensor_parallel, tp=2",
    "dtensor": "(c) DTensor parallelize_module + loss_parallel, tp=2",
}


# ----------------------------------------------------------------------------- model and batch


def make_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn,
        decoder_ffn_dim=args.ffn,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=max(64, args.seq_len + 2),
    )


def fixed_batch(cfg: ModelConfig, n: int, seq_len: int, seed: int) -> Seq2SeqBatch:
    """n pairs of exactly `seq_len` source and target tokens (no padding)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, cfg.vocab_size, (n, seq_len), generator=g)
    src[:, -1] = cfg.eos_token_id
    lab = torch.randint(4, cfg.vocab_size, (n, seq_len), generator=g)
    lab[:, -1] = cfg.eos_token_id
    dec = torch.empty_like(lab)
    dec[:, 0] = cfg.decoder_start_token_id
    dec[:, 1:] = lab[:, :-1]
    return Seq2SeqBatch(src, torch.ones_like(src), dec, lab)


# ----------------------------------------------------------------------------- the DTensor variant


def apply_dtensor_tp(model: M2M100Translation, mesh: Any) -> M2M100Translation:
    """DTensor tensor parallelism: one plan, no custom autograd code."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            for proj in ("q_proj", "kv_proj") if module.cross else ("qkv_proj",):
                plan[f"{name}.{proj}"] = ColwiseParallel()  # heads split (rows grouped by head)
            plan[f"{name}.out_proj"] = RowwiseParallel()
        elif name.endswith(".fc1"):
            plan[name] = ColwiseParallel()
        elif name.endswith(".fc2"):
            plan[name] = RowwiseParallel()
    # Tied vocabulary: `shared.weight` becomes a Shard(0) DTensor parameter; the embedding
    # lookup all-reduces its masked partial rows back to a plain replicated tensor.
    plan["shared"] = RowwiseParallel(input_layouts=Replicate())
    # LMHead(h, weight) = F.linear(h, shared.weight): make h a Replicate DTensor so the
    # matmul with the Shard(0) weight gives Shard(-1) logits, consumed by loss_parallel.
    plan["lm_head"] = PrepareModuleInput(
        input_layouts=(Replicate(), Shard(0)), desired_input_layouts=(Replicate(), Shard(0))
    )
    return parallelize_module(model, mesh, plan)  # type: ignore[return-value]


# ----------------------------------------------------------------------------- steps


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def make_steps(base: M2M100Translation, batch: Seq2SeqBatch) -> dict[str, tuple[nn.Module, Callable]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    single = copy.deepcopy(base)

    def step_single() -> Tensor:
        single.zero_grad(set_to_none=True)
        loss, n = single.loss(batch)
        (loss / n).backward()
        return loss.detach() / n

    ours = copy.deepcopy(base)
    info = apply_tensor_parallel(ours, dist.group.WORLD)

    def step_ours() -> Tensor:
        ours.zero_grad(set_to_none=True)
        loss, n = info.loss(ours(batch), batch.labels)
        (loss / n).backward()
        return loss.detach() / n

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    dt = apply_dtensor_tp(copy.deepcopy(base), mesh)

    def step_dtensor() -> Tensor:
        dt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss, n = dt.loss(batch)
            (loss / n).backward()
        return _local(loss.detach()) / n

    return {"single": (single, step_single), "ours": (ours, step_ours), "dtensor": (dt, step_dtensor)}


def full_grads(name: str, model: nn.Module) -> dict[str, Tensor]:
    if name == "ours":
        return gather_full_state_dict(model, dist.group.WORLD, grads=True)
    return {k: _local(p.grad).detach() for k, p in model.named_parameters() if p.grad is not None}


def check_parity(
    steps: dict[str, tuple[nn.Module, Callable]], batch: Seq2SeqBatch
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    ref_loss = steps["single"][1]()
    ref = full_grads("single", steps["single"][0])
    for name in ("ours", "dtensor"):
        model, step = steps[name]
        loss = step()
        got = full_grads(name, model)
        missing = sorted(set(ref) ^ set(got))
        worst_name, worst = "", 0.0
        for k, r in ref.items():
            if k in got:
                d = (got[k] - r).abs().max().item()
                if d > worst:
                    worst_name, worst = k, d
        out[name] = {
            "loss": float(loss),
            "loss_ref": float(ref_loss),
            "loss_abs_diff": abs(float(loss) - float(ref_loss)),
            "grad_max_abs_diff": worst,
            "grad_worst_param": worst_name,
            "grad_max_abs_ref": max(r.abs().max().item() for r in ref.values()),
            "params_missing_or_extra": missing,
        }
    out["dtensor"]["label_smoothing_0.1"] = check_label_smoothing(steps, batch, 0.1)
    return out


def check_label_smoothing(
    steps: dict[str, tuple[nn.Module, Callable]], batch: Seq2SeqBatch, eps: float
) -> str:
    """Does `model.loss(batch, label_smoothing=eps)` work under loss_parallel? (forward + backward)"""
    from torch.distributed.tensor.parallel import loss_parallel

    single, dt = steps["single"][0], steps["dtensor"][0]
    ref, n = single.loss(batch, label_smoothing=eps)
    try:
        with loss_parallel():
            got, _ = dt.loss(batch, label_smoothing=eps)
            (got / n).backward()
        return f"works, loss abs diff {abs(float(_local(got.detach())) - float(ref)) / n:.2e}"
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


# ----------------------------------------------------------------------------- worker


def worker(rank: int, world: int, argv: dict[str, Any]) -> dict[str, Any]:
    args = argparse.Namespace(**argv)
    torch.set_num_threads(1)
    cfg = make_config(args)
    torch.manual_seed(0)
    base = M2M100Translation(cfg)
    batch = fixed_batch(cfg, args.batch, args.seq_len, seed=1)
    steps = make_steps(base, batch)
    parity = check_parity(steps, batch)

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for it in range(args.warmup + args.iters):
        order = VARIANTS[it % 3 :] + VARIANTS[: it % 3]  # rotate so no variant always goes first
        for v in order:
            dist.barrier()
            t0 = time.perf_counter()
            steps[v][1]()
            dt = time.perf_counter() - t0
            if it >= args.warmup:
                times[v].append(dt)
    # a step's time is the slowest rank's
    mat = torch.tensor([times[v] for v in VARIANTS], dtype=torch.float64)
    dist.all_reduce(mat, op=dist.ReduceOp.MAX)
    return {"parity": parity, "times": {v: mat[i].tolist() for i, v in enumerate(VARIANTS)}}


# ----------------------------------------------------------------------------- reporting


def code_lines(source: str) -> int:
    """Lines holding code tokens, not counting comments, blank lines or docstrings."""
    lines: set[int] = set()
    prev = tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            if tok.type != tokenize.COMMENT:
                prev = tok.type if tok.type != tokenize.NL else prev
            continue
        if tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            prev = tokenize.STRING
            continue  # a docstring / bare string statement
        lines.update(range(tok.start[0], tok.end[0] + 1))
        prev = tok.type
    return len(lines)


def loc_notes() -> dict[str, Any]:
    import parallel.tp.apply as tp_apply
    import parallel.tp.comm as tp_comm
    import parallel.tp.layers as tp_layers
    import parallel.tp.loss as tp_loss

    sources = [inspect.getsource(m) for m in (tp_comm, tp_layers, tp_loss, tp_apply)]
    sp_names = {
        tp_apply: (
            "enable_sequence_parallel",
            "_make_scatter_hook",
            "_make_attention_gather_hook",
            "_make_gather_hook",
            "sync_sequence_parallel_grads",
        ),
        tp_comm: ("_GatherSeq", "_ReduceScatterSeq", "_ScatterSeq", "_GatherSeqReplicated"),
    }
    sp_loc = sum(code_lines(inspect.getsource(getattr(m, n))) for m, names in sp_names.items() for n in names)
    return {
        "ours_file_lines": sum(len(src.splitlines()) for src in sources),
        "ours_code_lines": sum(code_lines(src) for src in sources),
        "ours_sequence_parallel_code_lines": sp_loc,
        "dtensor_plan_code_lines": code_lines(inspect.getsource(apply_dtensor_tp)),
    }


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def summarize(
    res: list[dict[str, Any]], args: argparse.Namespace, up: tuple[str, str], wall: float
) -> dict[str, Any]:
    times = res[0]["times"]
    med = {v: statistics.median(times[v]) * 1e3 for v in VARIANTS}
    per_round = {v: [a / b for a, b in zip(times[v], times["ours"], strict=True)] for v in VARIANTS}
    ratio = {v: statistics.median(r) for v, r in per_round.items()}
    ratio_iqr = {v: statistics.quantiles(r, n=4)[::2] if len(r) > 1 else r * 2 for v, r in per_round.items()}
    parity = res[0]["parity"]
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "uptime_before": up[0],
        "uptime_after": up[1],
        "wall_s": wall,
        "median_ms": med,
        "min_ms": {v: min(times[v]) * 1e3 for v in VARIANTS},
        "ratio_vs_ours": ratio,
        "ratio_vs_ours_p25_p75": ratio_iqr,
        "dtensor_slower_rounds": sum(r > 1.0 for r in per_round["dtensor"]),
        "times_s": times,
        "parity": parity,
        "parity_rank1": res[1]["parity"],
        "loc": loc_notes(),
    }


NOTES = """\
Mechanisms:
- ours: 8 communication torch.autograd.Functions (f/g, last-dim gather/scatter, 4
  sequence-parallel ops) over a ProcessGroup, plus the vocab-parallel cross-entropy Function; Column/RowParallelLinear, VocabParallelEmbedding and
  VocabParallelLMHead built from the model's own modules (same parameter names, plain
  tensors marked tp_sharded / tp_shard_dim); a hand-written vocab-parallel cross-entropy
  (three (N,) all-reduces, label smoothing supported, vocabulary padded to a multiple of tp
  with masked padding logits). Downstream code relies on plain tensors + marks: the grad norm
  (parallel/parallelize.py reads tp_sharded / tp_shard_dim), checkpoint/eval gather
  (gather_full_state_dict), the zero-bubble W/B split (bias_in_matmul), dp bucketing and
  ZeRO-1 broadcast (_flatten_dense_tensors of p.grad / p.data in parallel/dp/reduce.py).
- dtensor: one plan dict; parameters become DTensors, module hooks convert activations
  at q/k/v/fc1 inputs (from_local Replicate: all-reduce of grads backward) and out_proj/fc2
  outputs (Partial -> Replicate all-reduce). The tied embedding/head is expressible without
  touching the model (RowwiseParallel(input_layouts=Replicate()) on `shared`, a
  PrepareModuleInput on `lm_head`), and the unchanged `model.loss` works under
  loss_parallel(). Limits seen in torch's own docs/code: loss_parallel does not support
  label_smoothing (configs/demo.yaml and the 1.2B config use 0.1), backward runs inside it,
  and with DTensor parameters/grads each of those trainer components would have to be ported.
  The plan does no sequence parallelism (SequenceParallel + PrepareModuleInput would add more).
  Same collectives in both: q, k and v each all-reduce their input gradient separately.
"""


def render(s: dict[str, Any]) -> str:
    a = s["config"]
    lines = [
        "# Tensor parallelism on CPU: explicit autograd functions vs DTensor",
        "",
        f"Model: d_model {a['d_model']}, {a['layers']}+{a['layers']} layers, {a['heads']} heads, "
        f"ffn {a['ffn']}, vocab {a['vocab']}; batch {a['batch']} x {a['seq_len']} tokens "
        f"(source and target), fp32, dropout 0.",
        f"2 gloo ranks, torch.set_num_threads(1) each; {a['warmup']} warm-up + {a['iters']} timed rounds, "
        "variants interleaved per round (rotated order, barrier before each step); "
        "step = zero_grad + forward + loss + backward, max over ranks.",
        f"torch {s['torch']}, Python {s['python']}, {s['machine']}. Wall {s['wall_s']:.0f} s.",
        f"Load before: `{s['uptime_before']}`",
        f"Load after:  `{s['uptime_after']}`",
        "",
        "| variant | step ms (median) | step ms (min) | ratio vs ours (median of per-round) "
        "| ratio p25..p75 | loss abs diff vs (a) | grad max abs diff vs (a) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        p = s["parity"].get(v)
        le = f"{p['loss_abs_diff']:.2e}" if p else "(reference)"
        ge = f"{p['grad_max_abs_diff']:.2e}" if p else "(reference)"
        lo, hi = s["ratio_vs_ours_p25_p75"][v]
        lines.append(
            f"| {LABELS[v]} | {s['median_ms'][v]:.1f} | {s['min_ms'][v]:.1f} | "
            f"{s['ratio_vs_ours'][v]:.3f} | {lo:.2f}..{hi:.2f} | {le} | {ge} |"
        )
    loc = s["loc"]
    ref_loss = s["parity"]["ours"]["loss_ref"]
    lines += [
        "",
        f"DTensor was slower than ours in {s['dtensor_slower_rounds']} of {a['iters']} rounds.",
        f"Reference loss {ref_loss:.6f}; largest reference gradient entry "
        f"{s['parity']['ours']['grad_max_abs_ref']:.3e}. Worst gradient: ours "
        f"`{s['parity']['ours']['grad_worst_param']}`, dtensor `{s['parity']['dtensor']['grad_worst_param']}`.",
        f"DTensor `model.loss(batch, label_smoothing=0.1)` under loss_parallel(): "
        f"{s['parity']['dtensor']['label_smoothing_0.1']}.",
        "",
        "Lines of code (code lines exclude comments, blanks, docstrings):",
        f"- ours: parallel/tp/ (4 modules) {loc['ours_file_lines']} lines, {loc['ours_code_lines']} code "
        f"lines, of which {loc['ours_sequence_parallel_code_lines']} for sequence parallelism "
        "(which the DTensor plan here does not do); the rest also covers vocab padding, "
        "label-smoothed vocab-parallel CE, grad norms and checkpoint gather.",
        f"- dtensor: `apply_dtensor_tp` in scripts/bench_tp.py, {loc['dtensor_plan_code_lines']} code lines "
        "(plus torch's DTensor machinery).",
        "",
        NOTES,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "tp_cpu")
    args = ap.parse_args(argv)

    up_before = uptime()
    t0 = time.perf_counter()
    res = run_distributed(
        worker, 2, args=({k: v for k, v in vars(args).items() if k != "out"},), timeout=args.timeout
    )
    summary = summarize(res, args, (up_before, uptime()), time.perf_counter() - t0)
    text = render(summary)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
