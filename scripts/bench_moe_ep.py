"""NLLB-MoE under expert parallelism, measured on CPU (gloo): the multi-process part of
`scripts/bench_moe.py` (run on its own too).

    python scripts/bench_moe_ep.py                  # both parts: benchmarks/moe_ep_cpu.{md,json}
    python scripts/bench_moe_ep.py --skip_memory    # all-to-all bytes only (a minute)

Memory (`memory_part`): real `trainer.train` runs (2 optimizer steps, fp32) of an expert-heavy
NLLB-MoE (d_model 256, 2 + 2 layers, every FFN 128 experts of width 768: 202M expert
parameters of 204M) as one process and on (dp 4, ep 4), one at a time, each rank's peak RSS
read from the run's run_summary.json (`scripts/bench_memory.run`). Goal (issue 24): the
largest rank's peak <= 0.40 x one process's. The planner's prediction for both runs is shown
beside them (`trainer.planner.search.predict_config`).

All-to-all bytes (`a2a_part`): 4 gloo ranks train 3 steps of a smaller sparse model on
several meshes below the trainer; the bytes the dispatcher sent to other ranks
(`parallel.expert.dispatch.A2AStats`, summed over ranks and steps) against the planner's
formula (`trainer.planner.moe.a2a_bytes`: uniform routing, (ep - 1) / ep of every kept
assignment, forward, backward and remat's recomputation) applied to the kept assignments the
routers reported (`SparseFFN.pop_stats`). Goal: within 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 2**20
MEMORY_GOAL, BYTES_GOAL = 0.40, 0.05
HEAVY = ["--config", "configs/tiny_moe.yaml", "--d_model", "256", "--encoder_ffn_dim", "768",
         "--decoder_ffn_dim", "768", "--num_experts", "128", "--encoder_sparse_step", "1",
         "--decoder_sparse_step", "1", "--max_steps", "2", "--do_eval", "false", "--save_steps", "0",
         "--logging_steps", "1", "--builtin_size", "400", "--max_source_length", "32",
         "--max_target_length", "32"]  # fmt: skip
MEMORY_LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "one process": (1, ["--per_device_train_batch_size", "8"]),
    "dp4 ep4": (4, ["--data_parallel_size", "4", "--expert_parallel_size", "4",
                    "--per_device_train_batch_size", "2"]),
}  # fmt: skip


# ----------------------------------------------------------------------------- memory


def memory_part(timeout: float, workdir: Path) -> list[dict[str, Any]]:
    """Each layout's measured peaks (MiB, max over ranks) and the planner's prediction."""
    from bench_memory import run

    rows = []
    for name, (world, flags) in MEMORY_LAYOUTS.items():
        args = [*HEAVY, *flags]
        print(f"[bench_moe_ep] memory: {name} ...", flush=True)
        row: dict[str, Any] = {"layout": name, "world": world, "args": args}
        try:
            mem = run(args, world, workdir / name.replace(" ", "_"), timeout, {})
            row["train_peak_mib"] = max(mem["train_peak_host_bytes"]) / MIB
            row["startup_mib"] = max(mem["startup_peak_host_bytes"]) / MIB
            row["per_rank_mib"] = [b / MIB for b in mem["train_peak_host_bytes"]]
            row["predicted_mib"] = _predicted(args, world)
        except RuntimeError as e:
            row["error"] = str(e)
        rows.append(row)
    return rows


def _predicted(args: list[str], world: int) -> float | None:
    """The planner's steady peak (MiB) of the most loaded rank, or None where it cannot cost it."""
    from trainer.config.parse import parse_config
    from trainer.planner.options import PlanOptions
    from trainer.planner.search import predict_config

    cfg = parse_config(list(args))
    opts = PlanOptions(config=args[1], world_size=world, link_gbps=1.0, repeats=1, calibrate="false")
    c = predict_config(cfg, list(args), opts)
    return None if isinstance(c, str) else sum(c.prediction.memory.values()) / MIB


# ----------------------------------------------------------------------------- all-to-all bytes

A2A_MODEL = dict(vocab_size=500, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=256, num_experts=8,
                 encoder_sparse_step=1, decoder_sparse_step=1, moe_token_dropout=0.0)  # fmt: skip
# name -> (pp, dp, tp, ep, m, schedule, remat, dropless)
A2A_LAYOUTS: dict[str, tuple[int, int, int, int, int, str, str, bool]] = {
    "dp4 ep4, dropless": (1, 4, 1, 4, 2, "1f1b", "none", True),
    "dp4 ep2, capacity 1.0": (1, 4, 1, 2, 2, "1f1b", "none", False),
    "pp2 dp2 ep2, full remat, capacity": (2, 2, 1, 2, 2, "1f1b", "full", False),
    "dp2 tp2 ep2, dropless": (1, 2, 2, 2, 2, "1f1b", "none", True),
}
A2A_BATCH, A2A_STEPS = 32, 3


def _batch(vocab: int, n: int, seed: int) -> Any:
    """n pairs, source and target lengths uniform in [8, 48] (padding excluded from routing)."""
    import torch

    from models.m2m100 import IGNORE_INDEX, Seq2SeqBatch

    g = torch.Generator().manual_seed(seed)
    sl, tl = (
        torch.randint(8, 49, (n,), generator=g).tolist(),
        torch.randint(8, 49, (n,), generator=g).tolist(),
    )
    src, lab = torch.full((n, max(sl)), 1), torch.full((n, max(tl)), IGNORE_INDEX)
    for i in range(n):
        src[i, : sl[i]] = torch.randint(4, vocab, (sl[i],), generator=g)
        src[i, sl[i] - 1] = 2
        lab[i, : tl[i]] = torch.randint(4, vocab, (tl[i],), generator=g)
    dec = torch.full_like(lab, 1)
    dec[:, 0] = 2
    dec[:, 1:] = lab[:, :-1].masked_fill(lab[:, :-1] == IGNORE_INDEX, 1)
    return Seq2SeqBatch(src, (src != 1).long(), dec, lab)


def _a2a_worker(rank: int, world: int, port: int, layout: tuple, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from models.config import ModelConfig
    from models.m2m100 import block_specs
    from parallel.mesh import ParallelDims, build_mesh
    from parallel.parallelize import build_parallel_model
    from parallel.pipeline.partition import uniform_partition
    from trainer.planner.moe import a2a_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pp, dp, tp, ep, m, schedule, remat, dropless = layout
    mc = ModelConfig(**A2A_MODEL)
    mesh = build_mesh(ParallelDims(pp=pp, dp=dp, tp=tp, world_size=world, ep=ep).validate(mc))
    balance = uniform_partition(len(block_specs(mc)), pp)
    pm = build_parallel_model(mc, mesh, balance, m, schedule, 1, remat, 0.0, seed=0)
    pm.model.moe.dropless = dropless
    opt = torch.optim.AdamW(pm.optimizer_params(), lr=1e-3)
    assert pm.ep_info is not None
    measured = predicted = 0.0
    for step in range(A2A_STEPS):
        batch = _batch(mc.vocab_size, A2A_BATCH, seed=step)
        share = batch.select(slice(mesh.dp_rank * A2A_BATCH // dp, (mesh.dp_rank + 1) * A2A_BATCH // dp))
        pm.ep_info.stats.reset()
        pm.train_step([share.split(m)], 1.0 / batch.num_tokens(), step=step)
        pm.grads.clip_(1.0)
        opt.step()
        pm.model.zero_grad(set_to_none=True)
        measured += pm.ep_info.stats.bytes_sent
        for ffn in pm.model.sparse_ffns().values():
            for st in ffn.pop_stats():  # one per micro-batch: assignments before capacity, drops
                kept = float(st.tokens_per_expert.sum() - st.dropped)
                predicted += a2a_bytes(kept, ep, mc.d_model, 4, 4, recompute=remat in ("full", "stage"))
    totals = torch.tensor([measured, predicted], dtype=torch.float64)
    dist.all_reduce(totals)
    if rank == 0:
        out.put(totals.tolist())
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def a2a_part() -> list[dict[str, Any]]:
    """Each mesh: measured and predicted bytes over all ranks and steps, and the error."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for name, layout in A2A_LAYOUTS.items():
        print(f"[bench_moe_ep] all-to-all bytes: {name} ...", flush=True)
        q = ctx.Queue()
        world = layout[0] * layout[1] * layout[2]
        port = _free_port()
        procs = [ctx.Process(target=_a2a_worker, args=(r, world, port, layout, q)) for r in range(world)]
        for p in procs:
            p.start()
        measured, predicted = q.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
        rows.append({"layout": name, "measured_bytes": measured, "predicted_bytes": predicted,
                     "error": predicted / measured - 1 if measured else None})  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- report


def report(memory: list[dict[str, Any]], a2a: list[dict[str, Any]]) -> str:
    lines = []
    if memory:
        one = next((r for r in memory if r["layout"] == "one process" and "error" not in r), None)
        lines += [
            "Peak host memory per rank (max over ranks, MiB; CPU, gloo, fp32, 2 steps) of an expert-heavy "
            f"NLLB-MoE (204M parameters, 202M in 4 x 128 experts). Goal: ep 4 <= {MEMORY_GOAL:.2f} x one process.",
            "",
            "| layout | ranks | train peak | x one process | start-up peak | planner | planner error |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in memory:
            if "error" in r:
                lines.append(f"| {r['layout']} | {r['world']} | failed: {r['error'].splitlines()[0]} |")
                continue
            ratio = f"{r['train_peak_mib'] / one['train_peak_mib']:.2f}" if one else "-"
            pred = r.get("predicted_mib")
            err = f"{pred / r['train_peak_mib'] - 1:+.1%}" if pred else "-"
            lines.append(f"| {r['layout']} | {r['world']} | {r['train_peak_mib']:.0f} | {ratio} | "
                         f"{r['startup_mib']:.0f} | {pred:.0f} | {err} |" if pred else
                         f"| {r['layout']} | {r['world']} | {r['train_peak_mib']:.0f} | {ratio} | "
                         f"{r['startup_mib']:.0f} | - | - |")  # fmt: skip
        lines.append("")
    if a2a:
        lines += [
            f"All-to-all bytes sent to other ranks (sum over ranks, {A2A_STEPS} steps of {A2A_BATCH} pairs; "
            "d_model 64, 8 experts in every layer): the dispatcher's count against the planner's formula "
            f"on the routers' kept assignments. Goal: within {BYTES_GOAL:.0%}.",
            "",
            "| mesh | measured MB | predicted MB | error |",
            "|---|---:|---:|---:|",
        ]
        for r in a2a:
            lines.append(f"| {r['layout']} | {r['measured_bytes'] / 1e6:.2f} | {r['predicted_bytes'] / 1e6:.2f} | "
                         f"{r['error']:+.2%} |")  # fmt: skip
    return "\n".join(lines)


def expert_parallel(skip_memory: bool = False, timeout: float = 1200) -> dict[str, Any]:
    """Both parts (what `scripts/bench_moe.py` adds to its results)."""
    workdir = Path(tempfile.mkdtemp(prefix="bench_moe_ep_"))
    return {"memory": [] if skip_memory else memory_part(timeout, workdir), "a2a": a2a_part()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip_memory", action="store_true", help="Only the all-to-all bytes.")
    ap.add_argument("--timeout", type=float, default=1200, help="Seconds per trainer run.")
    ap.add_argument("--out", default="benchmarks/moe_ep_cpu", help="Path stem of .json/.md ('' prints only).")
    opts = ap.parse_args(argv)
    res = expert_parallel(opts.skip_memory, opts.timeout)
    res["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    text = report(res["memory"], res["a2a"])
    print(text)
    if opts.out:
        stem = ROOT / opts.out
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
        stem.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
