"""The planner's output: plan.json rows, the printed table, and `--validate` runs against predictions.

rows / reasons      each candidate's flags, prediction, time and memory split, and a
                    one-line reason (its gap to #1, bubble, comm, optimizer, free memory)
validate            runs the top K with trainer.train (torchrun for several ranks) and
                    compares the median measured `step_time_s` and the executor's peak
                    activation bytes with the predictions
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainer.config.schema import JobConfig
from trainer.planner.cost import Candidate
from trainer.planner.hardware import GIB, DeviceSpec, LinkModel
from trainer.planner.layout import Family, Layout, family
from trainer.planner.options import PlanOptions

logger = logging.getLogger("trainer.plan")


def _reason(c: Candidate, best: Candidate, memory_gib: float | None) -> str:
    p, b = c.prediction, best.prediction
    head = "fastest predicted" if c is best else f"+{p.step_time_s / b.step_time_s - 1:.1%} vs #1"
    parts = [head, f"bubble {p.bubble_fraction:.1%}"]
    if c.layout.pp > 1:
        parts.append(f"p2p {p.link_s * 1e3:.2f} ms/msg")
    if p.grad_reduce_s:
        parts.append(f"reduce {p.grad_reduce_s * 1e3:.1f} ms")
    parts.append(f"optimizer {p.optimizer_s * 1e3:.1f} ms")
    if p.data_s:
        parts.append(f"data {p.data_s * 1e3:.1f} ms")
    if memory_gib:
        parts.append(f"{(memory_gib * GIB - p.peak_memory_bytes) / GIB:.1f} GiB free")
    return ", ".join(parts)


def build_report(
    cfg: JobConfig, opts: PlanOptions, device: DeviceSpec | None, link: LinkModel,
    memory_gib: float | None, candidates: list[Candidate], rejected: list[dict[str, str]], pruned: int,
    own: Candidate | str,
) -> dict[str, Any]:  # fmt: skip
    best = candidates[0] if candidates else None
    rows = [_row(i + 1, c, best, memory_gib) for i, c in enumerate(candidates)]
    if isinstance(own, Candidate):
        faster = sum(c.prediction.step_time_s < own.prediction.step_time_s for c in candidates)
        own_row: dict[str, Any] = _row(faster + 1, own, best or own, memory_gib)
    else:
        own_row = {"error": own}
    return {
        "config": opts.config,
        "world_size": opts.world_size,
        "gpus_per_node": opts.gpus_per_node or opts.world_size,
        "costs": f"device table: {device.name}" if device else "measured on this machine",
        "device_memory_gib": memory_gib,
        "link": asdict(link),
        "candidates": rows,
        "config_layout": own_row,
        "rejected_counts": dict(Counter(_reason_kind(r["reason"]) for r in rejected)),
        "pruned": pruned,
        "rejected": rejected,
    }


def _row(rank: int, c: Candidate, best: Candidate | None, memory_gib: float | None) -> dict[str, Any]:
    p = c.prediction
    return {
        "rank": rank,
        "args": c.args,
        "layout": asdict(c.layout),
        "predicted_step_time_s": p.step_time_s,
        "predicted_peak_memory_bytes": p.peak_memory_bytes,
        "predicted_bubble_fraction": p.bubble_fraction,
        "predicted_time_split_s": {"pipeline": p.makespan_s * c.layout.g, "grad_reduce": p.grad_reduce_s,
                                   "optimizer": p.optimizer_s, "data": p.data_s, "p2p_message": p.link_s,
                                   **({"teacher_forward": p.teacher_forward_s} if p.teacher_forward_s else {})},
        "predicted_memory_bytes": p.memory,
        "predicted_startup_memory_bytes": p.startup_memory_bytes,
        "predicted_step_transients_bytes": p.transients,
        "predicted_peak_activation_bytes_per_pp_rank": p.peak_activation_bytes_per_pp_rank,
        "parameters_per_pp_rank": p.params_per_pp_rank,
        "reason": _reason(c, best, memory_gib) if best else "",
    }  # fmt: skip


def _reason_kind(reason: str) -> str:
    return reason.split(":")[0] if reason.startswith(("does not fit", "trainer rejects")) else reason[:60]


def format_table(result: dict[str, Any], top: int) -> str:
    """The ranked candidates (first `top`) and the rejection counts, as text."""
    lines = [
        f"plan for {result['config']} on {result['world_size']} ranks ({result['gpus_per_node']} per node), "
        f"costs {result['costs']}",
        f"{'#':>3} {'pp':>2} {'tp':>2} {'dp':>2} {'ep':>2} {'m':>3} {'g':>2} {'mb':>5}  {'schedule':<19} {'remat':<9} "
        f"{'partition':<10} {'dp shard':<8} {'step s':>9} {'bubble':>6} {'peak GiB':>8} {'start GiB':>9}  why",
    ]
    for row in result["candidates"][:top]:
        lay = row["layout"]
        sched = f"{lay['schedule']}" + (f" v={lay['v']}" if lay["v"] > 1 else "")
        lines.append(
            f"{row['rank']:>3} {lay['pp']:>2} {lay['tp']:>2} {lay['dp']:>2} {lay.get('ep', 1):>2} {lay['m']:>3} {lay['g']:>2} "
            f"{lay['microbatch']:>5}  {sched:<19} {lay['remat']:<9} {lay['partition']:<10} "
            f"{lay.get('sharding', 'none'):<8} {row['predicted_step_time_s']:>9.4g} "
            f"{row['predicted_bubble_fraction']:>6.1%} {row['predicted_peak_memory_bytes'] / GIB:>8.2f} "
            f"{row['predicted_startup_memory_bytes'] / GIB:>9.2f}  {row['reason']}"
        )
    own = result["config_layout"]
    if "error" in own:
        lines.append(f"the config's own layout cannot run here: {own['error']}")
    else:
        lay = own["layout"]
        lines.append(
            f"the config's own layout (pp={lay['pp']} tp={lay['tp']} dp={lay['dp']} ep={lay.get('ep', 1)} m={lay['m']} "
            f"{lay['schedule']} v={lay['v']} remat={lay['remat']} dp shard={lay.get('sharding', 'none')}) would rank #{own['rank']}: "
            f"{own['predicted_step_time_s']:.4g} s/step, bubble {own['predicted_bubble_fraction']:.1%}, "
            f"{own['predicted_peak_memory_bytes'] / GIB:.2f} GiB"
        )
    calibration = result.get("calibration")
    if isinstance(calibration, list):
        for c in calibration:
            m = c["mesh"]
            lines.append(
                f"calibrated pp={m['pp']} tp={m['tp']} dp={m['dp']} {c['schedule']}: compute x"
                f"{c['compute_scale']:.2f}, step offset {c['step_offset_s'] * 1e3:+.2f} ms "
                f"(measured {c['measured_step_time_s']:.4g} s, uncalibrated model {c['model_step_time_s']:.4g} s)"
            )
    elif calibration:
        lines.append(f"not calibrated: {calibration}")
    lines.append(
        f"{len(result['candidates'])} layouts fit; {result['pruned']} not simulated (their lower bound is "
        f"slower than the best kept); rejected: {result['rejected_counts'] or 'none'}"
    )
    return "\n".join(lines)


def validate(result: dict[str, Any], k: int, opts: PlanOptions) -> list[dict[str, Any]]:
    """Run the top `k` candidates with trainer.train; predicted vs measured step time and memory.

    Step time: the median over `opts.validate_repeats` runs of each run's median `step_time_s`
    after `opts.validate_warmup` steps. Memory: the median over steps of the largest
    `peak_activation_bytes_stage_*` (the executor's meter) against the predicted peak
    activations of the most loaded pp rank.

    The host's speed drifts between the calibration and the validation (+-20% over minutes on
    a shared 2-core CPU), so each round also re-runs every calibration layout: `drift` is
    its family's re-measured step over the one measured at plan time, and
    `step_time_error_at_drift` compares the measurement with the prediction times that drift.
    """
    root = run_root(opts, "validate")
    cal = result.get("calibration")
    cal_rows: list[dict[str, Any]] = cal if isinstance(cal, list) else []
    jobs = {f"candidate_{r['rank']}": r["args"] for r in result["candidates"][:k]}
    jobs.update(
        {f"recalibrate_{i}": c["args"] for i, c in enumerate(cal_rows) if c["args"] not in jobs.values()}
    )
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in jobs}
    for rep in range(opts.validate_repeats):  # rounds: every job once per round, so drift is shared
        for i, (name, args) in enumerate(jobs.items()):
            logger.info(
                "validation round %d/%d, run %d/%d: %s with trainer.train -> %s",
                rep + 1, opts.validate_repeats, i + 1, len(jobs), name, root / name / f"run_{rep}",
            )  # fmt: skip
            runs[name].append(_run_once(args, opts.world_size, root / name / f"run_{rep}", opts))
    by_args = {tuple(jobs[n]): statistics.median(r["step_time_s"] for r in runs[n]) for n in jobs}
    drift = {_family(c["layout"]): by_args[tuple(c["args"])] / c["measured_step_time_s"] for c in cal_rows}
    out = []
    for row in result["candidates"][:k]:
        name, pred = f"candidate_{row['rank']}", row["predicted_step_time_s"]
        measured = statistics.median(r["step_time_s"] for r in runs[name])
        d = drift.get(_family(row["layout"]))
        out.append({
            "rank": row["rank"], "predicted_step_time_s": pred, "measured_step_time_s": measured,
            "step_time_error": measured / pred - 1,
            "drift": d, "step_time_error_at_drift": measured / (pred * d) - 1 if d else None,
            "predicted_peak_activation_bytes": max(row["predicted_peak_activation_bytes_per_pp_rank"]),
            "measured_peak_activation_bytes": statistics.median(r["peak_activation_bytes"] for r in runs[name]),
            "output_dir": str(root / name), "calibration_layout": row["args"] in [c["args"] for c in cal_rows],
            "measured_step_time_s_runs": [r["step_time_s"] for r in runs[name]],
        })  # fmt: skip
    return out


def _family(layout: dict[str, Any]) -> Family:
    """A plan.json layout's calibration family."""
    return family(Layout(**layout))


def run_root(opts: PlanOptions, kind: str) -> Path:
    """Where calibration / validation runs write: --validate_dir, else a new temporary directory."""
    return Path(opts.validate_dir or tempfile.mkdtemp(prefix=f"plan_{kind}_"))


def run_candidate(args: list[str], world: int, out_dir: Path, opts: PlanOptions) -> dict[str, Any]:
    """Train `args` `opts.validate_repeats` times; the median over runs of each run's medians.

    One run's median step moves by up to +-20% from run to run on a shared 2-core CPU host
    (same data, same layout: 35-51 ms), so each layout is run several times.
    `step_time_s_runs` keeps every run's median.
    """
    runs = [
        _run_once(args, world, out_dir / f"run_{i}" if opts.validate_repeats > 1 else out_dir, opts)
        for i in range(opts.validate_repeats)
    ]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["step_time_s_runs"] = [r["step_time_s"] for r in runs]
    return out


def _run_once(args: list[str], world: int, out_dir: Path, opts: PlanOptions) -> dict[str, float]:
    """Train `args` for `opts.validate_steps` steps into `out_dir`; median step time, compute and peak.

    Raises:
        RuntimeError: the run failed or timed out (its stderr's tail in the message).
    """
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [*(launcher if world > 1 else [sys.executable]), "-m", "trainer.train", *args,
           "--output_dir", str(out_dir), "--overwrite_output_dir", "true",
           "--max_steps", str(opts.validate_steps), "--logging_steps", "1", "--do_eval", "false",
           "--save_steps", "0", "--report_to", "none", "--disable_tqdm", "true", "--plots", "false"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=opts.validate_timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"trainer run timed out after {opts.validate_timeout} s: {' '.join(cmd)}"
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(f"trainer run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "step_time_s" in r][opts.validate_warmup :]
    if not steps:
        raise RuntimeError(
            f"no step rows after {opts.validate_warmup} warm-up steps in {out_dir}/metrics.jsonl"
        )
    # per step the most loaded stage's peak, then the median step (the prediction is for the mean shape)
    peaks = [max(v for k, v in r.items() if k.startswith("peak_activation_bytes_stage_")) for r in steps]
    peak = statistics.median(peaks)
    compute = statistics.median(
        sum(v for k, v in r.items() if k.startswith("stage_compute_s_")) for r in steps
    )  # the pipeline's compute per step, summed over pp ranks
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in steps),
        "peak_activation_bytes": peak,
        "compute_s": compute,
    }


def format_validation(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'#':>3} {'predicted s':>11} {'measured s':>10} {'error':>7} {'drift':>6} {'at drift':>8} "
        f"{'act MiB pred':>12} {'act MiB meas':>12}"
    ]
    for r in rows:
        lines.append(
            f"{r['rank']:>3} {r['predicted_step_time_s']:>11.4g} {r['measured_step_time_s']:>10.4g} "
            f"{r['step_time_error']:>+7.1%} "
            + (
                f"{r['drift']:>6.3f} {r['step_time_error_at_drift']:>+8.1%} "
                if r.get("drift")
                else f"{'-':>6} {'-':>8} "
            )
            + f"{r['predicted_peak_activation_bytes'] / 2**20:>12.2f} "
            f"{r['measured_peak_activation_bytes'] / 2**20:>12.2f}"
            + (
                f"  runs {min(runs):.4g}-{max(runs):.4g}"
                if len(runs := r.get("measured_step_time_s_runs", [])) > 1
                else ""
            )
            + ("  (its family's calibration layout)" if r.get("calibration_layout") else "")
        )
    if rows:
        best = min(rows, key=lambda r: r["measured_step_time_s"])
        lines.append(
            f"measured best: #{best['rank']}; predicted best #1 is "
            f"{rows[0]['measured_step_time_s'] / best['measured_step_time_s'] - 1:+.1%} from it"
        )
    return "\n".join(lines)
