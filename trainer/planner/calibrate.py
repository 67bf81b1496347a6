"""Calibrate the planner's cost model with short runs of the real trainer, one per mesh and backward kind.

The block profile (`trainer.planner.blocks.measure_kind_costs`) times each block alone, one process, warm
and repeated. The trainer's step differs in ways the profile cannot see and that depend on
the mesh: the executor's per-action work (activation meter, p2p bookkeeping, recompute
wrappers), ranks sharing the host's caches, memory bandwidth and cores, and every collective
of a step (the timed step's start barrier, the guard's all-reduce, gradient-norm and logged-
loss reduces, gloo's real all-reduce speed) which costs nothing on the one-rank mesh that
`trainer.planner.measure.measure_overheads` runs on. On a 2-core CPU host, for example, the block
profile under-predicted a pipeline rank's compute by 1.5-2x and a step's fixed costs by
10-20 ms.

So where the planned world runs on this machine, each family -- a mesh (pp, tp, dp) and
whether the schedule splits the backward into I and W (zero_bubble, zbv) -- is run with
`trainer.train` for a few steps (`--validate_repeats` runs) on one of its layouts (the one
with the smallest lower bound, 1F1B or zero_bubble preferred), and two numbers are fitted
from those runs' metrics.jsonl:

    compute_scale   measured pipeline compute (the executor's `stage_compute_s_*`, summed over
                    pp ranks) / the predicted compute of the same layout
    step_offset_s   measured median step time - the prediction with compute scaled

Every layout of that family is then predicted with its stage compute times compute_scale
and step_offset_s added to its step (`apply`). What the fit leaves to the model: the
schedule within the family, the micro-batch cut, the partition and remat, i.e. what the
planner chooses between. The split backward needs its own fit: on the 2-core host the
executor's I + W cost 1.2-1.4x its full B, where the block profile has 1.08x. The
validation report marks a validated layout that is its family's calibration layout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from parallel.pipeline.simulate import StageCosts
from trainer.errors import ConfigError
from trainer.planner.cost import CostContext, lower_bound, predict_step
from trainer.planner.layout import Family, Layout, family
from trainer.planner.options import PlanOptions

logger = logging.getLogger("trainer.plan")


Pending = tuple[float, Layout, StageCosts, CostContext]


@dataclass(frozen=True)
class Calibration:
    """One family's fit: the layout run, what it measured, and the two fitted numbers."""

    layout: Layout
    args: list[str]
    measured_step_time_s: float
    predicted_step_time_s: float  # before calibration
    measured_compute_s: float  # per step, summed over pp ranks
    predicted_compute_s: float
    compute_scale: float
    step_offset_s: float


def local_capacity() -> tuple[int, str]:
    """(ranks this machine can run at once without sharing a device or core, what they are)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "CUDA devices"
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    return max(1, (os.cpu_count() or 1) // threads), f"CPU cores at OMP_NUM_THREADS={threads}"


def should_calibrate(opts: PlanOptions, measured_here: bool) -> tuple[bool, str]:
    """Whether to calibrate (`--calibrate auto|true|false`), and why not when not."""
    if opts.calibrate == "false":
        return False, "--calibrate false"
    if not measured_here:
        return False, "costs come from the device table (--device)"
    capacity, what = local_capacity()
    if opts.world_size > capacity:
        why = f"--world_size {opts.world_size} > {capacity} {what} on this machine"
        if opts.calibrate == "true":
            raise ConfigError(f"--calibrate true needs the world to run here: {why}")
        return False, why
    return True, ""


def calibration_layouts(pending: Sequence[Pending]) -> dict[Family, Pending]:
    """Per family, the entry it is calibrated on: the smallest lower bound, 1F1B / zero_bubble first."""
    chosen: dict[Family, Pending] = {}
    for entry in sorted(pending, key=lambda e: (e[1].schedule not in ("1f1b", "zero_bubble"), e[0])):
        chosen.setdefault(family(entry[1]), entry)
    return chosen


def predicted_compute_s(layout: Layout, sc: StageCosts) -> float:
    """A step's pipeline compute summed over pp ranks: g m (F + I + W) of every stage."""
    per_mb = sum(sc.forward) + sum(sc.backward_input) + sum(sc.backward_weight)
    return layout.g * layout.m * per_mb


def scaled(sc: StageCosts, scale: float) -> StageCosts:
    """Stage costs with every compute time times `scale` (the link and activations as they are)."""
    return replace(
        sc,
        forward=[x * scale for x in sc.forward],
        backward_input=[x * scale for x in sc.backward_input],
        backward_weight=[x * scale for x in sc.backward_weight],
    )


def fit(
    layout: Layout, sc: StageCosts, ctx: CostContext, measured: dict[str, float], args: list[str]
) -> Calibration:
    """The family's compute scale and step offset from one measured run of `layout`."""
    pred_compute = predicted_compute_s(layout, sc)
    scale = measured["compute_s"] / pred_compute if pred_compute > 0 else 1.0
    before = predict_step(layout, sc, ctx).step_time_s
    after = predict_step(layout, scaled(sc, scale), ctx).step_time_s
    return Calibration(
        layout, args, measured["step_time_s"], before, measured["compute_s"], pred_compute,
        scale, measured["step_time_s"] - after,
    )  # fmt: skip


def calibrate(
    pending: Sequence[Pending], to_args: Callable[[Layout], list[str]], opts: PlanOptions, root: Path
) -> dict[Family, Calibration]:
    """Run each family's calibration layout with trainer.train (its flags: `to_args`, the planner's
    `layout_args` over the job's) and fit it (module docstring)."""
    from trainer.planner.report import run_candidate

    out: dict[Family, Calibration] = {}
    chosen = calibration_layouts(pending)
    for i, (fam, (_, layout, sc, ctx)) in enumerate(chosen.items()):
        args = to_args(layout)
        run_dir = root / f"calibrate_pp{fam[0]}_tp{fam[1]}_dp{fam[2]}_{layout.schedule}"
        logger.info(
            "calibration run %d/%d: pp=%d tp=%d dp=%d %s, %d steps -> %s", i + 1, len(chosen), *fam[:3],
            layout.schedule, opts.validate_steps, run_dir,
        )  # fmt: skip
        measured = run_candidate(args, opts.world_size, run_dir, opts)
        cal = fit(layout, sc, ctx, measured, args)
        logger.info(
            "calibrated pp=%d tp=%d dp=%d %s: compute x%.2f, step offset %+.2f ms (measured %.4f s, model %.4f s)",
            *fam[:3], layout.schedule, cal.compute_scale, cal.step_offset_s * 1e3, cal.measured_step_time_s, cal.predicted_step_time_s,
        )  # fmt: skip
        out[fam] = cal
    return out


def apply(pending: Sequence[Pending], fits: dict[Family, Calibration]) -> list[Pending]:
    """Every entry with its family's fit applied: compute scaled, the step offset added, bound redone."""
    out = []
    for _, layout, sc, ctx in pending:
        cal = fits.get(family(layout))
        if cal is not None:
            sc = scaled(sc, cal.compute_scale)
            ctx = replace(ctx, step_overhead_s=ctx.step_overhead_s + cal.step_offset_s)
        out.append((lower_bound(layout, sc, ctx), layout, sc, ctx))
    return out


def report(fits: dict[Family, Calibration]) -> list[dict[str, Any]]:
    """plan.json's `calibration` rows."""
    return [
        {
            "mesh": {"pp": m[0], "tp": m[1], "dp": m[2]},
            "schedule": c.layout.schedule,
            "layout": asdict(c.layout),
            "args": c.args,
            "measured_step_time_s": c.measured_step_time_s,
            "model_step_time_s": c.predicted_step_time_s,
            "measured_compute_s": c.measured_compute_s,
            "model_compute_s": c.predicted_compute_s,
            "compute_scale": c.compute_scale,
            "step_offset_s": c.step_offset_s,
        }  # fmt: skip
        for m, c in fits.items()
    ]
