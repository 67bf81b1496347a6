"""Peak host memory per rank of real `trainer.train` runs on CPU (gloo), one layout at a time,
against the planner's prediction (`trainer.planner.memory`).

    python scripts/bench_memory.py                      # the 361M model, every layout
    python scripts/bench_memory.py --model small --layouts one,pp4   # a ~50M quick check
    python scripts/bench_memory.py --model 100m --layouts one,pp4,pp2_tp2   # a ~105M check

Each layout runs configs/bench_memory_361m.yaml (2 optimizer steps, a small fixed batch) with its
mesh flags under torch.distributed.run, and its measured peaks are the run's own
run_summary.json `memory` fields (every rank's ru_maxrss, trainer.run.memory): the training
peak (before the final checkpoint), the whole run's, and the start-up peak (model and optimizer
built). Each layout runs under glibc as shipped and under glibc returning freed chunks of 1 MiB
or more (`--malloc`): the first is what a job gets, the second the live bytes the planner
models (glibc keeps freed heap chunks resident: trainer.planner.memory's docstring). The prediction is `trainer.planner.search.predict_config` on the same flags: the most
loaded rank's steady peak and its start-up peak, the host baseline included.

Writes <output>.json and <output>.md (default benchmarks/memory_cpu, or memory_cpu_<model>).
A layout this checkout cannot run (an option the trainer rejects, or data_parallel_sharding
fsdp without parallel/dp/fsdp.py) fails with its reason before anything is launched; a run that
fails or passes --timeout is killed and reported. The exit status is 1 if any layout failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = "configs/bench_memory_361m.yaml"
MIB = 2**20
MODELS: dict[str, list[str]] = {
    "361m": [],
    "small": ["--d_model", "512", "--encoder_layers", "6", "--decoder_layers", "6",
              "--encoder_attention_heads", "8", "--decoder_attention_heads", "8",
              "--encoder_ffn_dim", "2048", "--decoder_ffn_dim", "2048"],
    "100m": ["--d_model", "768", "--encoder_layers", "6", "--decoder_layers", "6",
             "--encoder_attention_heads", "12", "--decoder_attention_heads", "12",
             "--encoder_ffn_dim", "3072", "--decoder_ffn_dim", "3072"],
}  # fmt: skip
# name -> (world size, flags)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "one": (1, []),
    "pp4": (4, ["--pipeline_parallel_size", "4", "--num_microbatches", "4"]),
    "pp2_tp2": (4, ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2", "--num_microbatches", "2"]),
    "dp4_none": (4, ["--data_parallel_size", "4", "--data_parallel_sharding", "none"]),
    "dp4_zero1": (4, ["--data_parallel_size", "4", "--data_parallel_sharding", "zero1"]),
    "dp4_fsdp": (4, ["--data_parallel_size", "4", "--data_parallel_sharding", "fsdp"]),
    "pp2_dp2_tp2_fsdp": (8, ["--pipeline_parallel_size", "2", "--data_parallel_size", "2",
                             "--tensor_parallel_size", "2", "--num_microbatches", "2",
                             "--data_parallel_sharding", "fsdp"]),
}  # fmt: skip
# Issue 18's "before" column: main before stage-local construction, 361M model, MiB per rank
BEFORE_MIB = {"one": "7442", "pp4": "2641", "pp2_tp2": "2591", "dp4_zero1": "6592 (OOM-killed)"}


def layout_args(model: str, name: str) -> tuple[int, list[str]]:
    world, flags = LAYOUTS[name]
    return world, ["--config", CONFIG, *MODELS[model], *flags]


def unsupported(args: list[str], world: int) -> str:
    """Why this checkout cannot run `args` (the trainer's own early check), or ""."""
    from trainer.config.parse import parse_config
    from trainer.run.preflight import validate_early

    try:
        cfg = parse_config(list(args))
        validate_early(cfg, world)
    except (ValueError, SystemExit) as e:
        return f"the trainer rejects it: {e}"
    if cfg.parallel.data_parallel_sharding == "fsdp" and not (ROOT / "parallel" / "dp" / "fsdp.py").is_file():
        return "data_parallel_sharding=fsdp is not implemented in this checkout (no parallel/dp/fsdp.py)"
    return ""


def predict(args: list[str], world: int) -> dict[str, float]:
    """The planner's steady and start-up peaks (bytes) of the most loaded rank, and its terms."""
    from trainer.config.parse import parse_config
    from trainer.planner.options import PlanOptions
    from trainer.planner.search import predict_config

    cfg = parse_config(list(args))
    opts = PlanOptions(config=CONFIG, world_size=world, link_gbps=1.0, repeats=1, calibrate="false")
    c = predict_config(cfg, list(args), opts)
    if isinstance(c, str):
        raise RuntimeError(f"the planner cannot cost this layout: {c}")
    p = c.prediction
    return {"steady": sum(p.memory.values()), "startup": p.startup_memory_bytes, **p.memory}


# The allocators a layout runs under: glibc as shipped, and glibc returning every chunk of 1 MiB or
# more to the system on free (its peak RSS is then the live bytes the planner predicts)
MALLOCS: dict[str, dict[str, str]] = {
    "stock": {},
    "returning": {"MALLOC_MMAP_THRESHOLD_": str(2**20)},
}


def run(args: list[str], world: int, out: Path, timeout: float, malloc_env: dict[str, str]) -> dict[str, Any]:
    """Train `args` on `world` CPU ranks into `out`; the run_summary.json memory fields.

    Raises:
        RuntimeError: the run failed or passed `timeout` (its process group is killed).
    """
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [*(launcher if world > 1 else [sys.executable]), "-m", "trainer.train", *args,
           "--output_dir", str(out), "--dist_timeout_s", str(int(timeout))]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        **malloc_env,
    }
    log = out.with_suffix(".log")
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"timed out after {timeout:.0f} s (killed); log {log}") from None
    try:
        if rc != 0:
            tail = log.read_text()[-1500:]
            why = " (killed: out of memory?)" if rc in (-9, 137) else ""
            raise RuntimeError(f"exit status {rc}{why}; log {log}:\n{tail}")
        return json.loads((out / "run_summary.json").read_text())["memory"]
    finally:  # its checkpoint (GBs for the 361M model, x2 allocators x 7 layouts) is not needed
        shutil.rmtree(out, ignore_errors=True)


def measure(model: str, name: str, root: Path, timeout: float, mallocs: list[str]) -> dict[str, Any]:
    """One layout: the prediction, then a run under each allocator (MiB, max over ranks)."""
    world, args = layout_args(model, name)
    row: dict[str, Any] = {
        "layout": name,
        "world": world,
        "args": args,
        "before_mib": BEFORE_MIB.get(name) if model == "361m" else None,
        "error": None,
    }
    why = unsupported(args, world)
    if why:
        return {**row, "error": why}
    try:
        pred = predict(args, world)
        row["predicted"] = pred
        row["predicted_peak_mib"] = max(pred["steady"], pred["startup"]) / MIB
        row["predicted_startup_mib"] = pred["startup"] / MIB
        for malloc in mallocs:
            t0 = time.perf_counter()
            mem = run(args, world, root / f"{name}_{malloc}", timeout, MALLOCS[malloc])
            row[malloc] = {
                "memory": mem,
                "wall_s": time.perf_counter() - t0,
                "train_peak_mib": max(mem["train_peak_host_bytes"]) / MIB,
                "run_peak_mib": max(mem["peak_host_bytes"]) / MIB,
                "startup_mib": max(mem["startup_peak_host_bytes"]) / MIB,
            }
    except RuntimeError as e:
        return {**row, "error": str(e)}
    return row


def table(rows: list[dict[str, Any]], model: str, mallocs: list[str]) -> str:
    """Measured train peak per allocator, its ratio to one process, the prediction and its error."""
    one = next((r for r in rows if r["layout"] == "one" and not r["error"]), None)
    head = ["layout", "ranks", "before (issue)"]
    for m in mallocs:
        head += [f"{m}: train peak", f"{m}: x one", f"{m}: run peak", f"error vs {m}"]
    head += ["predicted", "start-up measured", "start-up predicted", "error"]
    lines = [
        f"Peak host memory per rank (max over ranks, MiB), model {model}, CPU gloo, 2 steps. train = "
        "before the final checkpoint, run = whole run; stock = glibc as shipped, returning = "
        "MALLOC_MMAP_THRESHOLD_=1 MiB (freed chunks go back to the system: the live bytes the planner "
        "predicts). error = predicted / measured - 1.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [r["layout"], str(r["world"]), r["before_mib"] or "-"]
        if r["error"]:
            lines.append("| " + " | ".join(cells + [f"failed: {r['error'].splitlines()[0]}"]) + " |")
            continue
        for m in mallocs:
            got = r[m]
            ratio = got["train_peak_mib"] / one[m]["train_peak_mib"] if one else None
            cells += [f"{got['train_peak_mib']:.0f}", f"{ratio:.2f}" if ratio else "-", f"{got['run_peak_mib']:.0f}",
                      f"{r['predicted_peak_mib'] / got['train_peak_mib'] - 1:+.1%}"]  # fmt: skip
        start = r[mallocs[-1]]["startup_mib"]
        cells += [f"{r['predicted_peak_mib']:.0f}", f"{start:.0f}", f"{r['predicted_startup_mib']:.0f}",
                  f"{r['predicted_startup_mib'] / start - 1:+.1%}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="361m")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {list(LAYOUTS)}")
    ap.add_argument("--timeout", type=float, default=1200, help="Seconds per run before it is killed.")
    ap.add_argument(
        "--output",
        default=None,
        help="Path stem of the .json and .md (default benchmarks/memory_cpu[_<model>]).",
    )
    ap.add_argument(
        "--malloc",
        default="stock,returning",
        help=f"comma list of {list(MALLOCS)}: each layout runs under each.",
    )
    ap.add_argument("--workdir", default=None, help="Where the runs write (default: a temporary directory).")
    opts = ap.parse_args(argv)
    names = [x for x in opts.layouts.replace(" ", "").split(",") if x]
    bad = sorted(set(names) - set(LAYOUTS))
    if bad or not names:
        ap.error(f"--layouts {bad or names} unknown; choose from {list(LAYOUTS)}")
    mallocs = [x for x in opts.malloc.replace(" ", "").split(",") if x]
    if not mallocs or set(mallocs) - set(MALLOCS):
        ap.error(f"--malloc {mallocs} unknown; choose from {list(MALLOCS)}")
    stem = Path(opts.output or f"benchmarks/memory_cpu{'' if opts.model == '361m' else '_' + opts.model}")
    root = Path(opts.workdir or tempfile.mkdtemp(prefix="bench_memory_"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:  # one at a time: the host's memory is shared
        print(f"[bench_memory] {name} ...", flush=True)
        rows.append(measure(opts.model, name, root, opts.timeout, mallocs))
        print(f"[bench_memory] {name}: {rows[-1]['error'] or 'ok'}", flush=True)
    text = table(rows, opts.model, mallocs)
    print(text)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"model": opts.model, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(text + "\n")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
