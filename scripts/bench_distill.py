"""Word-level distillation measured on CPU (gloo): the teacher's bytes per rank against the formula, and
the distillation step against the student's step and the teacher's forward, each alone (issue 35).

    python scripts/bench_distill.py                 # benchmarks/distill_cpu.{md,json}
    python scripts/bench_distill.py --steps 6 --warmup 2 --world 4

One torchrun group (this script under `--worker`) builds the student as `trainer.train` does
(`trainer.run.setup.setup_run`, configs/tiny.yaml's data) and a random NLLB-MoE teacher written as an
HF directory on the student's tokenizer, then:

    memory   the teacher built on the mesh (`trainer.run.distill.build_teacher`, stage-local, working
             dtype) in fp32 and bf16: each rank's allocated parameter bytes and the growth of its
             resident memory (RSS) across the build, against params x bytes / (pp x tp x ep) and the
             planner's exact per-rank prediction (`trainer.planner.teacher.teacher_step`)
    time     on the same global batches, step by step in turn, each timed alone between barriers:
             A the student's optimizer step (plain loss), B the teacher's forward-only flushes over
             the step's micro-batches, C the distillation step (B inside it, the KD loss); goal
             C <= 1.15 (A + B); the model FLOPs of each (2 per multiply-add, top-2 experts counted)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIB = 2**20
GOAL_TIME, GOAL_MEMORY = 1.15, 0.10
TEACHER = dict(d_model=256, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=1024, decoder_ffn_dim=1024, num_experts=8, encoder_sparse_step=2,
               decoder_sparse_step=2, dropout=0.0, attention_dropout=0.0, moe_token_dropout=0.0)  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8, help="ranks: pp 2 x tp 2 x dp (ep = dp)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "distill_cpu"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def rss() -> int:
    """This process's resident set now (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def student_config(work: Path, world: int) -> list[str]:
    """The student's run (alpha 0: the teacher is named, for its vocabulary and experts, not built)."""
    dp = world // 4
    return ["--config", "configs/tiny.yaml", "--output_dir", str(work / "student"), "--pipeline_parallel_size", "2",
            "--teacher_model_name_or_path", str(work / "teacher"), "--distillation_alpha", "0",
            "--tensor_parallel_size", "2", "--data_parallel_size", str(dp), "--expert_parallel_size", str(dp),
            "--num_microbatches", "4", "--per_device_train_batch_size", str(32 // (4 * dp)), "--builtin_size", "800",
            "--dropout", "0", "--attention_dropout", "0", "--do_eval", "false", "--max_steps", "1000",
            "--report_to", "none", "--disable_tqdm", "true", "--plots", "false", "--logging_steps", "1000"]  # fmt: skip


def write_teacher(work: Path, world: int) -> None:
    """A random NLLB-MoE (init std 0.2) as an HF directory, on the tokenizer the student's run would
    train on its data (the student then takes it: `trainer.run.distill`)."""
    from models.config import ModelConfig
    from models.hf_save import save_hf_model
    from models.m2m100 import M2M100Translation
    from trainer.config.parse import parse_config
    from trainer.data.sources import load_raw_datasets, training_texts
    from trainer.run.data import run_tokenizer

    cfg = parse_config(student_config(work, world))
    cfg.model.teacher_model_name_or_path = None
    tok = run_tokenizer(cfg, training_texts(load_raw_datasets(cfg.data, cfg.training.seed).train))
    out = work / "teacher"
    mc = ModelConfig(vocab_size=tok.vocab_size, init_std=0.2, **TEACHER, **tok.special_ids())  # type: ignore[arg-type]
    tmp = out.with_name(out.name + ".tmp")
    save_hf_model(M2M100Translation(mc, seed=5).state_dict(), mc, tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


def worker(args: argparse.Namespace) -> None:  # noqa: PLR0915 - one measured story, in order
    import torch
    import torch.distributed as dist

    from parallel.mesh import init_distributed
    from trainer.config.parse import parse_config
    from trainer.run.distill import build_teacher, teacher_source
    from trainer.run.outdir import claim_output_dir
    from trainer.run.preflight import validate_early
    from trainer.run.setup import setup_run
    from trainer.run.step import train_step

    torch.set_num_threads(1)
    init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = Path(args.work)
    cfg = parse_config(student_config(work, world))
    dims = validate_early(cfg, world)
    out: dict[str, Any] = {}
    with claim_output_dir(cfg.training, rank) as outdir:
        ctx = setup_run(cfg, dims, outdir)
        source = teacher_source(str(work / "teacher"))
        cfg.training.distillation_alpha = 0.5
        pm = ctx.pm
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", None)):
            dist.barrier()
            before = rss()
            loss = build_teacher(cfg, source, ctx.mesh, pm.device, pm, dtype)
            grown = rss() - before
            out[name] = {"parameter_bytes": loss.teacher.parameter_bytes, "rss_growth_bytes": grown,
                         "params": sum(p.numel() for p in loss.teacher.pm.model.parameters()),
                         "pp_rank": ctx.mesh.pp_rank}  # fmt: skip
            if name == "bf16":
                del loss
                pm.executor, pm.before_flush = pm._executor(pm.plan.schedule[pm.mesh.pp_rank], pm.grads), None
        kd_exec, hook, teacher = pm.executor, pm.before_flush, loss.teacher
        plain_exec = pm._executor(pm.plan.schedule[pm.mesh.pp_rank], pm.grads)
        times: dict[str, list[float]] = {"student": [], "teacher": [], "distill": []}
        lengths = []
        pm.model.train()

        def timed(fn: Any) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            return time.perf_counter() - t0

        def distill(gb: Any, step: int) -> None:
            pm.executor, pm.before_flush = kd_exec, hook
            train_step(pm, ctx.optimizer, ctx.scheduler, gb, ctx.mesh.dp_rank, 1.0, step, distill=loss)

        def student(gb: Any, step: int) -> None:
            pm.executor, pm.before_flush = plain_exec, None
            train_step(pm, ctx.optimizer, ctx.scheduler, gb, ctx.mesh.dp_rank, 1.0, step)

        def forward(gb: Any, step: int) -> None:
            for flush in gb.shard(ctx.mesh.dp_rank):
                teacher.forward(pm._prepare(flush), step)
                teacher.hidden.clear()

        for step in range(1, args.warmup + args.steps + 1):
            gb = next(ctx.sampler)
            lengths.append(gb.example_lengths())
            row = {name: timed(functools.partial(fn, gb, step))
                   for name, fn in (("distill", distill), ("student", student), ("teacher", forward))}  # fmt: skip
            if step > args.warmup:
                for k, v in row.items():
                    times[k].append(v)
        out["times"] = times
        out["lengths"] = [[list(map(int, s)), list(map(int, t))] for s, t in lengths[args.warmup :]]
        out["teacher_config"] = source.config.to_dict()
        out["student_config"] = pm.model.config.to_dict()
        out["mesh"] = {
            "pp": dims.pp,
            "tp": dims.tp,
            "dp": dims.dp,
            "ep": dims.ep,
            "m": cfg.parallel.num_microbatches,
        }
        rows = [None] * world
        dist.all_gather_object(rows, out)
        if rank == 0:
            (work / "result.json").write_text(json.dumps(rows))
        ctx.sampler.close()
    dist.destroy_process_group()


def flops(mc: Any, src: list[int], tgt: list[int], forward_only: bool) -> float:
    """Model FLOPs over these pairs (`trainer.planner.blocks.block_forward_flops` per sentence: top-2
    experts and the router counted); a training step is 3 forwards."""
    from models.config import ModelConfig
    from models.m2m100 import block_specs
    from trainer.planner.blocks import Shape, block_forward_flops, kind_key

    cfg = ModelConfig.from_dict(mc)
    total = sum(
        block_forward_flops(cfg, kind_key(cfg, spec), Shape(1, s, t))[0]
        for s, t in zip(src, tgt)
        for spec in block_specs(cfg)
    )
    return total if forward_only else 3 * total


def report(rows: list[dict[str, Any]], args: argparse.Namespace, load: tuple[str, str]) -> dict[str, Any]:
    from models.config import ModelConfig
    from parallel.pipeline.profile import BlockPhases
    from trainer.planner.blocks import Shape
    from trainer.planner.hardware import LinkModel
    from trainer.planner.layout import Layout
    from trainer.planner.teacher import TeacherBlocks, teacher_step

    r0 = rows[0]
    mesh = r0["mesh"]
    tmc = ModelConfig.from_dict(r0["teacher_config"])
    total = tmc.num_parameters()
    pp, tp, ep = mesh["pp"], mesh["tp"], mesh["ep"]
    n_blocks = tmc.encoder_layers + tmc.decoder_layers + 4
    tb = TeacherBlocks(
        tmc, tuple(BlockPhases(0, 0, 0, 0, 0) for _ in range(n_blocks)), Shape(1, 1, 1), tp, ep
    )
    layout = Layout(pp, tp, mesh["dp"], mesh["m"], 1, 1, "1f1b", 1, "none", "uniform", (1,) * pp, ep=ep)
    memory = {}
    for name, e in (("bf16", 2), ("fp32", 4)):
        predicted = teacher_step(layout, tb, LinkModel(0, 1, 0, 1), 8, half=e == 2).startup_bytes_per_pp_rank
        per_rank = [r[name] for r in rows]
        formula = total * e / (pp * tp * ep)
        memory[name] = {
            "formula_bytes": formula,
            "allocated_bytes": [r["parameter_bytes"] for r in per_rank],
            "planner_bytes": [predicted[r["pp_rank"]] for r in per_rank],
            "max_allocated_over_formula": max(r["parameter_bytes"] for r in per_rank) / formula,
        }
        if name == "bf16":  # built first, in a fresh heap (the fp32 one reuses what it freed)
            memory[name]["rss_growth_bytes"] = [r["rss_growth_bytes"] for r in per_rank]
            memory[name]["max_rss_growth_over_formula"] = max(memory[name]["rss_growth_bytes"]) / formula
    t = {k: statistics.median(v) for k, v in r0["times"].items()}
    f_student = statistics.mean(flops(r0["student_config"], s, tt, False) for s, tt in r0["lengths"])
    f_teacher = statistics.mean(flops(r0["teacher_config"], s, tt, True) for s, tt in r0["lengths"])
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), torch CPU, gloo, 1 thread per rank",
        "load": load, "mesh": mesh, "teacher_parameters": total,
        "student_parameters": ModelConfig.from_dict(r0["student_config"]).num_parameters(),
        "memory": memory, "median_s": t, "samples_s": r0["times"],
        "distill_over_sum": t["distill"] / (t["student"] + t["teacher"]),
        "flops": {"student_step": f_student, "teacher_forward": f_teacher,
                  "flop_ratio_distill_over_sum": 1.0, "teacher_forward_over_student_step": f_teacher / f_student},
        "time_ratio_teacher_over_student": t["teacher"] / t["student"],
    }  # fmt: skip


def markdown(res: dict[str, Any], args: argparse.Namespace) -> str:
    m, mem = res["mesh"], res["memory"]
    lines = [
        "# Word-level distillation on CPU: teacher memory per rank, step time", "",
        f"Generated by `python scripts/bench_distill.py --world {args.world} --steps {args.steps} --warmup "
        f"{args.warmup}` on {res['machine']}. Load average at start / end: {res['load'][0]} / {res['load'][1]}.",
        "",
        f"Mesh pp {m['pp']} x tp {m['tp']} x dp {m['dp']} (ep {m['ep']}), m = {m['m']} micro-batches of the "
        f"32-pair global batch (configs/tiny.yaml's built-in corpus). Teacher: random NLLB-MoE, d_model 256, "
        f"4 + 4 layers, 8 experts in every 2nd layer, {res['teacher_parameters'] / 1e6:.2f}M parameters; "
        f"student: configs/tiny.yaml, {res['student_parameters'] / 1e6:.2f}M.", "",
        "## Teacher bytes per rank", "",
        "| precision | formula params x bytes / (pp tp ep) | allocated, max over ranks | x formula | RSS growth, max | x formula | planner (exact), max |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for name, row in mem.items():
        rss = (f"{max(row['rss_growth_bytes']) / MIB:.2f} MiB | {row['max_rss_growth_over_formula']:.3f}"
               if "rss_growth_bytes" in row else "- | -")  # fmt: skip
        lines.append(
            f"| {name} | {row['formula_bytes'] / MIB:.2f} MiB | {max(row['allocated_bytes']) / MIB:.2f} MiB | "
            f"{row['max_allocated_over_formula']:.3f} | {rss} | {max(row['planner_bytes']) / MIB:.2f} MiB |"
        )
    t, f = res["median_s"], res["flops"]
    lines += [
        "", "Per rank (allocated MiB, " + ", ".join(mem) + "): "
        + "; ".join(f"{n}: " + " ".join(f"{b / MIB:.1f}" for b in row["allocated_bytes"]) for n, row in mem.items()),
        "", "Allocated: the bytes of the rank's teacher parameters (`Teacher.parameter_bytes`, also in "
        "`run_summary.json`'s `memory.teacher_parameter_bytes`). The formula divides every parameter by ep; "
        "the dense part is not cut over ep and the tied embedding sits on the first and the last stage, "
        "which the planner counts. RSS growth: the rank's resident memory across the teacher's build "
        "(glibc returning freed chunks: MALLOC_MMAP_THRESHOLD_=1 MiB); it also holds the pages of the "
        "safetensors file the rank read its slices through (mmap) and one fp32 tensor read at a time.",
        "", "## Step time", "",
        "| | median s | model GFLOPs |", "|---|---:|---:|",
        f"| A student step alone | {t['student']:.3f} | {f['student_step'] / 1e9:.3f} |",
        f"| B teacher forward alone (its flushes over the step's micro-batches) | {t['teacher']:.3f} | {f['teacher_forward'] / 1e9:.3f} |",
        f"| C distillation step | {t['distill']:.3f} | {(f['student_step'] + f['teacher_forward']) / 1e9:.3f} |",
        "", f"C / (A + B) = **{res['distill_over_sum']:.3f}** (goal <= {GOAL_TIME}); the FLOP ratio predicts 1.0: "
        "C runs A's and B's work, the teacher's head product moved from B's last stage into the KD loss. "
        f"B / A: {res['time_ratio_teacher_over_student']:.2f} measured, "
        f"{f['teacher_forward_over_student_step']:.2f} by FLOPs.", "",
    ]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    load0 = open("/proc/loadavg").read().split()[0]
    with tempfile.TemporaryDirectory(prefix="bench_distill_") as tmp:
        write_teacher(Path(tmp), args.world)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
               __file__, "--worker", "--work", tmp, "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        rows = json.loads((Path(tmp) / "result.json").read_text())
    res = report(rows, args, (load0, open("/proc/loadavg").read().split()[0]))
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    text = markdown(res, args)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
