"""The project's benchmark, one command: every figure a ratio against a peer measured in the same run.

    python scripts/bench.py --quick                     # CPU, 2-4 minutes on 2 cores
    python scripts/bench.py --output outputs/bench      # + the GPU table where CUDA is present
    python scripts/bench.py --skip_cpu                  # GPU only (the CPU part is the slow half)

Writes OUTPUT/bench.json and OUTPUT/bench.md, and keeps the latest of each kind in
`benchmarks/` (`bench_cpu.*`, `bench_gpu_<device>.*`), the machine named.

CPU part:
- one process (`scripts/bench_step.py`): our step against `transformers`' M2M100 in
  a plain loop on the same batch and weights, alternating steps:
  `host_syncs_per_microbatch` (device-to-host reads in one micro-batch's forward and
  backward through the executor, counted by a dispatch mode), `ops_per_microbatch_vs_hf`
  (aten ops, ours / HF) and `step_time_vs_hf`;
- one process (`scripts/bench_host.py`): the CPU proxy of a micro-batch's host cost, at a
  size where the arithmetic is negligible: host time and aten ops + kernels per micro-batch
  for eager, compiled (`torch_compile`) and bucketed (`pad_to_multiple_of`) against today's
  eager in the same run (`host_time_per_microbatch_vs_eager`, `launches_per_microbatch`),
  recompiles after the warm-up, compiled == eager (`benchmarks/host_proxy_cpu.md`);
- two gloo ranks (`scripts/bench_pipeline.py`): our GPipe, 1F1B and interleaved
  schedules against `torch.distributed.pipelining` on the same stages
  (`gpipe_vs_torch_pipelining`, ...), the measured bubble over the simulator's
  prediction from the stage costs and link measured in the same run
  (`bubble_measured_over_simulated`), and the simulator's step-time error
  (`simulator_error`, |predicted - measured| / measured makespan).

GPU part (`bench_step.py` on the issue's cases: 418M and 1.2B at m=1, 418M with
variable lengths and with 4 and 8 micro-batches, 60M): `mfu`, `step_time_vs_hf_eager`,
`step_time_vs_hf_compile`, peak memory and synchronisations per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

GPU_CASES = "418m,1.2b,418m_var,418m_m4,418m_m8,60m"
GPU_COMPILE_CASES = "418m,1.2b"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_step_bench(cases: str, steps: int, extra: list[str], out: Path) -> list[dict[str, Any]]:
    """bench_step.py in a subprocess (its own process group and device state)."""
    path = out / f"step_{cases.replace(',', '_')}.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench_step.py"), "--cases", cases, "--steps", str(steps)]
    subprocess.run([*cmd, *extra, "--json", str(path)], check=True, cwd=ROOT)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def run_pipeline_bench(quick: bool, out: Path) -> dict[str, Any]:
    prefix = out / "pipeline"
    cmd = [sys.executable, str(ROOT / "scripts/bench_pipeline.py"), "--out", str(prefix)]
    cmd += ["--steps", "4", "--skip_memory"] if quick else ["--steps", "10"]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(prefix.with_suffix(".json").read_text())  # type: ignore[no-any-return]


def run_host_bench(quick: bool, out: Path, save: bool) -> dict[str, Any]:
    """bench_host.py in a subprocess (it starts one more for its static-graph variant)."""
    cmd = [sys.executable, str(ROOT / "scripts/bench_host.py"), "--output", str(out)]
    cmd += (["--repeats", "7"] if quick else []) + ([] if save else ["--no_save"])
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads((out / "host_proxy.json").read_text())  # type: ignore[no-any-return]


def host_keys(host: dict[str, Any]) -> dict[str, Any]:
    rows = host["rows"]
    return {
        "host_time_per_microbatch_vs_eager": {v: r["host_time_vs_eager"] for v, r in rows.items()},
        "launches_per_microbatch": {v: r["launches_per_microbatch"] for v, r in rows.items()},
        "recompiles_after_warmup": {
            v: r["recompiles_after_warmup"] for v, r in rows.items() if "compiled" in v
        },
        "compiled_vs_eager_loss_rel_diff": {
            v: r["loss_rel_diff_vs_eager"] for v, r in rows.items() if "compiled" in v
        },
    }


def cpu_keys(step_rows: list[dict[str, Any]], pipe: dict[str, Any]) -> dict[str, Any]:
    keys: dict[str, Any] = {
        "host_syncs_per_microbatch": {r["case"]: r["ours_host_reads_per_microbatch"] for r in step_rows},
        "ops_per_microbatch_vs_hf": {r["case"]: r["ops_per_microbatch_vs_hf"] for r in step_rows},
        "step_time_vs_hf": {r["case"]: r["step_time_vs_hf"] for r in step_rows},
    }
    names = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved_1f1b": "interleaved"}
    for row in pipe["steps"]:
        if row["workload"] == "fixed" and row["engine"] == "ours" and row["schedule"] in names:
            keys[f"{names[row['schedule']]}_vs_torch_pipelining"] = row["ours_over_torch_median"]
        if row["workload"] == "varlen" and row["engine"] == "ours" and "ours_over_torch_median" in row:
            keys[f"{names[row['schedule']]}_varlen_vs_torch_pipelining"] = row["ours_over_torch_median"]
    keys["bubble_measured_over_simulated"] = {
        b["schedule"]: b["measured"] / b["simulated"] if b["simulated"] else None for b in pipe["bubble"]
    }
    keys["simulator_error"] = {
        b["schedule"]: abs(b["makespan_simulated_s"] - b["makespan_measured_s"]) / b["makespan_measured_s"]
        for b in pipe["bubble"]
    }
    keys["bubble"] = {
        b["schedule"]: {"measured": b["measured"], "simulated": b["simulated"], "theory": b["theory"]}
        for b in pipe["bubble"]
    }
    return keys


def gpu_keys(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def per_case(key: str) -> dict[str, float]:
        return {r["case"]: r[key] for r in rows if key in r}

    return {
        "mfu": per_case("ours_mfu"),
        "mfu_hf": per_case("hf_mfu"),
        "step_time_vs_hf_eager": per_case("step_time_vs_hf"),
        "step_time_vs_hf_compile": per_case("step_time_vs_hf_compile"),
        "compiled_step_time_vs_hf_compile": {
            r["case"]: r["ours_compile_step_s"] / r["hf_compile_step_s"]
            for r in rows
            if "ours_compile_step_s" in r
        },
        "peak_memory_gib": per_case("ours_peak_gib"),
        "peak_memory_gib_hf": per_case("hf_peak_gib"),
        "cuda_syncs_per_step": per_case("ours_cuda_syncs_per_step"),
        "cuda_syncs_per_step_hf": per_case("hf_cuda_syncs_per_step"),
    }


def fmt(x: Any) -> str:
    if isinstance(x, dict):
        return ", ".join(f"{k} {fmt(v)}" for k, v in x.items())
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def render(result: dict[str, Any]) -> str:
    from bench_step import table

    lines = ["# Benchmark", "", f"Machine: {fmt(result['machine'])}. Wall time {result['wall_s']:.0f} s.", ""]
    if "cpu" in result:
        lines += ["## CPU (ratios: ours / peer, same run)", "", "| key | value |", "|---|---|"]
        lines += [f"| `{k}` | {fmt(v)} |" for k, v in result["cpu"].items()]
        lines += [
            "",
            "One process, ours vs `transformers` (alternating steps):",
            "",
            table(result["cpu_rows"]),
            "",
        ]
    if "gpu" in result:
        lines += ["## GPU", "", "| key | value |", "|---|---|"]
        lines += [f"| `{k}` | {fmt(v)} |" for k, v in result["gpu"].items()]
        lines += ["", table(result["gpu_rows"]), ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (CPU part in 2-4 minutes on 2 cores)")
    ap.add_argument("--output", default="outputs/bench", help="writes bench.json and bench.md here")
    ap.add_argument("--skip_cpu", action="store_true", help="only the GPU part")
    ap.add_argument("--gpu_cases", default=GPU_CASES)
    ap.add_argument("--no_compile", action="store_true", help="skip the compiled variants (GPU)")
    ap.add_argument("--gpu_compile_cases", default=GPU_COMPILE_CASES, help="GPU cases also timed compiled")
    ap.add_argument("--gpu_impls", default="", help="GPU: only these sides (bench_step.py --impls)")
    ap.add_argument("--gpu_steps", type=int, default=5, help="GPU: timed steps per block of 3")
    ap.add_argument("--no_save", action="store_true", help="do not copy the results into benchmarks/")
    ap.add_argument("--skip_host_proxy", action="store_true", help="skip the CPU proxy of host cost")
    args = ap.parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    if not args.skip_cpu:
        rows = run_step_bench("cpu_small,cpu_small_m4", 6 if args.quick else 12, [], out)
        result["cpu_rows"] = rows
        result["cpu"] = cpu_keys(rows, run_pipeline_bench(args.quick, out))
        if not args.skip_host_proxy:
            result["cpu"].update(host_keys(run_host_bench(args.quick, out, not args.no_save)))
    if torch.cuda.is_available():
        cases = [c for c in args.gpu_cases.split(",") if c]
        compiled = [] if args.no_compile else [c for c in cases if c in args.gpu_compile_cases.split(",")]
        impls = ["--impls", args.gpu_impls] if args.gpu_impls else []
        rows = []
        if compiled:
            rows += run_step_bench(",".join(compiled), args.gpu_steps, ["--compile", *impls], out)
        rest = [c for c in cases if c not in compiled]
        if rest:
            rest_impls = ",".join(i for i in args.gpu_impls.split(",") if "compile" not in i)
            rows += run_step_bench(
                ",".join(rest), args.gpu_steps, ["--impls", rest_impls] if rest_impls else [], out
            )
        result["gpu_rows"] = rows
        result["gpu"] = gpu_keys(rows)
    result["wall_s"] = time.perf_counter() - t0
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(render(result))
    print(render(result))
    if not args.no_save:
        save_latest(result, out)
    return result


def save_latest(result: dict[str, Any], out: Path) -> None:
    """benchmarks/ keeps the latest CPU and GPU results, named by the machine."""
    bench_dir = ROOT / "benchmarks"
    gpu = result["machine"].get("gpu", "")
    kind = "gpu_" + gpu.replace("NVIDIA ", "").split()[0].lower() if "gpu" in result else "cpu"
    if "gpu" in result and "cpu" in result:
        kind = "cpu_" + kind
    for suffix in ("json", "md"):
        shutil.copy(out / f"bench.{suffix}", bench_dir / f"bench_{kind}.{suffix}")


if __name__ == "__main__":
    main()
