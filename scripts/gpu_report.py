"""The report of `scripts/gpu_check.sh`: what ran, what it measured, against issue 34's goals.

    python scripts/gpu_report.py OUT [--seconds S]

Reads OUT/parts.jsonl (one line per part of the check), the benchmarks' JSON (OUT/bench_<case>/
bench.json, OUT/moe_<experts>.json) and the runs' run_summary.json; writes OUT/gpu_check.md and
.json, and on a GPU the same as `benchmarks/gpu_<card>.md` and `.json` (`h100` for an NVIDIA H100).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def goal_of(key: str) -> str:
    """Issue 34's goal for a figure of `goals` ("" where it sets none)."""
    if key.startswith("m8_over_m1_throughput"):
        return ">= 0.6"
    if key.startswith("mfu_"):
        return ">= 0.35"
    return "<= 0.4 (HF as shipped)" if key == "moe_32_ours_over_hf" else ""


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def collect(out: Path) -> dict[str, Any]:
    parts = [json.loads(line) for line in (out / "parts.jsonl").read_text().splitlines() if line.strip()]
    rows = []
    for case in ("418m", "418m_m8", "1.2b"):
        bench = _load(out / f"bench_{case}" / "bench.json")
        rows += bench.get("gpu_rows", []) if bench else []
    gpu = next((b["machine"].get("gpu") for c in ("418m", "418m_m8", "1.2b")
                if (b := _load(out / f"bench_{c}" / "bench.json"))), None)  # fmt: skip
    moe = {e: _load(out / f"moe_{e}.json") for e in (32, 128)}
    summaries = {
        name: _load(out / name / "run_summary.json") for name in ("tiny_compile", "streaming", "tiny_moe")
    }
    env = (
        (out / "environment.log").read_text().strip().splitlines()
        if (out / "environment.log").is_file()
        else []
    )
    if gpu is None and env and not env[-1].endswith("no CUDA"):  # no benchmark ran: the probe's device
        gpu = env[-1].split(" ", 3)[-1]
    return {"parts": parts, "gpu_rows": rows, "gpu": gpu, "moe": moe, "summaries": summaries,
            "environment": env[-1] if env else platform.platform()}  # fmt: skip


def goals(res: dict[str, Any]) -> dict[str, Any]:
    """The issue's GPU goals from what was measured (None where a figure is missing)."""
    by_case = {r["case"]: r for r in res["gpu_rows"]}
    out: dict[str, Any] = {}
    one, eight = by_case.get("418m"), by_case.get("418m_m8")
    for impl in ("ours", "ours_compile"):
        if one and eight and f"{impl}_step_s" in one and f"{impl}_step_s" in eight:
            out[f"m8_over_m1_throughput_{impl}"] = one[f"{impl}_step_s"] / eight[f"{impl}_step_s"]
    for case in ("418m", "1.2b"):
        for impl in ("ours", "ours_compile"):
            if case in by_case and f"{impl}_mfu" in by_case[case]:
                out[f"mfu_{case}_{impl}"] = by_case[case][f"{impl}_mfu"]
    for experts, data in res["moe"].items():
        if data and data.get("one_process"):
            ratios = data["one_process"][0]["ratios"]
            out[f"moe_{experts}_ours_over_hf"] = ratios["ours_over_hf"]
            out[f"moe_{experts}_ours_over_hf_4_57"] = ratios["ours_over_hf_4_57"]
    return out


def render(res: dict[str, Any]) -> str:
    lines = [f"# GPU check: {res['gpu'] or 'no GPU'}", "", f"`scripts/gpu_check.sh`, {res['seconds']} s in all. "
             f"Python, torch, transformers, device: {res['environment']}.", "", "| part | status |", "|---|---|"]  # fmt: skip
    lines += [f"| {p['part']} | {p['status']} |" for p in res["parts"]]
    if res["gpu_rows"]:
        lines += ["", "## Step time (ours eager and compiled against transformers, same weights and batch)", "",
                  "| case | ours s/step | ours compiled s/step | HF s/step | ours / HF | compiled / eager "
                  "| MFU ours / compiled / HF | peak GiB ours / compiled / HF |",
                  "|---|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
        for r in res["gpu_rows"]:
            oc = r.get("ours_compile_step_s")
            mfu = " / ".join(
                f"{r[k]:.1%}" if k in r else "-" for k in ("ours_mfu", "ours_compile_mfu", "hf_mfu")
            )
            mem = " / ".join(
                f"{r[k]:.1f}" if k in r else "-"
                for k in ("ours_peak_gib", "ours_compile_peak_gib", "hf_peak_gib")
            )
            compiled = "-" if oc is None else f"{oc:.4f}"
            speedup = "-" if oc is None else f"{oc / r['ours_step_s']:.2f}"
            lines.append(
                f"| {r['case']} | {r['ours_step_s']:.4f} | {compiled} | {r['hf_step_s']:.4f} "
                f"| {r['ours_step_s'] / r['hf_step_s']:.2f} | {speedup} | {mfu} | {mem} |"
            )
    g = res["goals"]
    if g:
        lines += ["", "## Issue 34's goals", "", "| figure | measured | goal |", "|---|---:|---|"]
        lines += [f"| `{k}` | {v:.3g} | {goal_of(k)} |" for k, v in g.items()]
    s = res["summaries"]
    if s.get("tiny_compile"):
        lines += [
            "",
            f"torch_compile (tiny, {s['tiny_compile']['steps']} steps): {s['tiny_compile']['compile']}",
        ]
    if s.get("streaming"):
        share = s["streaming"].get("data_time_share", 0.0)
        lines += ["", f"Streaming, 2 data workers: data wait {share:.2%} of the step time."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seconds", type=int, default=0, help="the check's wall time")
    args = ap.parse_args(argv)
    out = Path(args.out)
    res = collect(out)
    res["seconds"] = args.seconds
    res["goals"] = goals(res)
    text = render(res)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "gpu_check.md").write_text(text)
    print(text)
    if res["gpu"]:
        card = res["gpu"].replace("NVIDIA ", "").split()[0].lower()
        for suffix in ("md", "json"):
            (ROOT / "benchmarks" / f"gpu_{card}.{suffix}").write_text(
                (out / f"gpu_check.{suffix}").read_text()
            )
    return res


if __name__ == "__main__":
    main()
