"""The planner's search: enumerate layouts, cost them, calibrate, rank (`python -m trainer.plan`'s
library; the usage and the stages are in `trainer/plan.py`).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterator
from dataclasses import fields, replace
from functools import partial
from typing import Any

import torch

from parallel.errors import ParallelConfigError
from parallel.mesh import ParallelDims
from parallel.pipeline.simulate import StageCosts
from trainer.config.dims import parallel_dims
from trainer.config.parse import parse_config
from trainer.config.schema import JobConfig
from trainer.errors import BAD_INPUT
from trainer.planner.blocks import Shape, block_param_counts
from trainer.planner.calibrate import Calibration, apply, calibrate, should_calibrate
from trainer.planner.calibrate import report as calibration_rows
from trainer.planner.cost import (
    Candidate,
    CostContext,
    balance_from_costs,
    layout_stage_costs,
    lower_bound,
    predict_step,
)
from trainer.planner.hardware import GIB, DeviceSpec, LinkModel, device_spec
from trainer.planner.layout import Family, Layout, describe, layout_args, layout_fields
from trainer.planner.measure import CostSource, measure_link, measure_optimizer_s_per_param, measure_overheads
from trainer.planner.memory import HOST_BASELINE_BYTES
from trainer.planner.options import PlanOptions
from trainer.planner.report import build_report, run_root
from trainer.planner.space import (
    PARTITION_SPACE,
    REMAT_SPACE,
    batch_budget,
    batch_cuts,
    meshes,
    schedule_space,
    sharding_space,
)
from trainer.progress import Progress

logger = logging.getLogger("trainer.plan")


def check_args(args: list[str], world: int) -> JobConfig:
    """Parse the candidate's flags as trainer.train does and run its early validation.

    Raises:
        ValueError: whatever `parse_config` or `validate_early` reject.
    """
    from trainer.run.preflight import validate_early

    cfg = parse_config(list(args))
    validate_early(cfg, world)
    return cfg


def plan(cfg: JobConfig, base_args: list[str], opts: PlanOptions) -> dict[str, Any]:
    """Enumerate, predict_step, filter and rank; returns what plan.json holds.

    Candidates are simulated in order of their lower bound (`trainer.planner.cost.lower_bound`); once
    `opts.keep` fitting candidates are known, one whose bound exceeds the keep-th best
    prediction cannot enter the table and is counted as pruned instead of simulated.
    """
    world, gpn = opts.world_size, opts.gpus_per_node or opts.world_size
    device = device_spec(opts.device, cfg.training.half_precision) if opts.device else None
    logger.info(
        "phase 1/5: the job's architecture%s", " and the data's batch shapes" if opts.seq_len is None else ""
    )
    source = CostSource(cfg, opts, device)
    memory_gib = opts.device_memory_gib or (device.memory_gib if device else None)
    ctx = cost_context(cfg, opts, source, device)
    link = ctx.link
    calibrating, why_not = should_calibrate(opts, measured_here=device is None)
    if device is None and not calibrating:  # what the block profile misses, on a one-rank mesh
        logger.info("no calibration runs (%s): executor overheads from a one-rank run", why_not)
        shape0 = source.shape(*_own_cut(cfg, world))
        ctx.action_overhead_s, ctx.step_overhead_s = measure_overheads(
            cfg, source.mc, shape0, source.kind_costs(shape0, "none"), ctx.optimizer_s_per_param
        )
    pending, rejected = enumerate_layouts(cfg, opts, source, ctx)
    if calibrating:
        logger.info("phase 3/5: calibrating with short trainer.train runs (one per mesh and backward kind)")
    else:
        logger.info("phase 3/5: no calibration runs (%s)", why_not)
    to_args = partial(layout_args, base=base_args, job=cfg.parallel)
    fits = calibrate(pending, to_args, opts, run_root(opts, "calibrate")) if calibrating else {}
    candidates, pruned = _simulate_best(apply(pending, fits), memory_gib, opts, rejected)
    logger.info("phase 5/5: the config's own layout and the top %d candidates' flags", opts.top)
    for c in candidates[: opts.top]:  # the printed rows: their flags through the trainer's own parser
        c.args = to_args(c.layout)
        check_args(c.args, world)
    for c in candidates[opts.top :]:
        c.args = to_args(c.layout)
    own = own_layout(cfg, base_args, source, ctx, world, gpn, fits)
    result = build_report(cfg, opts, device, link, memory_gib, candidates, rejected, pruned, own)
    result["calibration"] = calibration_rows(fits) if calibrating else why_not
    return result


def enumerate_layouts(
    cfg: JobConfig, opts: PlanOptions, source: CostSource, ctx: CostContext
) -> tuple[list[tuple[float, Layout, StageCosts, CostContext]], list[dict[str, str]]]:
    """Every layout the trainer accepts, costed with its lower bound; and every one rejected, with why.

    Costing measures each (micro-batch shape, remat, tp) once, here or from the device table
    (`CostSource`): the long part of a plan for a large model. A bar (or a line every 30 s)
    counts the (mesh, batch cut) pairs.
    """
    world, gpn = opts.world_size, opts.gpus_per_node or opts.world_size
    budget = batch_budget(cfg, world)
    valid, rejected_meshes = meshes(world, gpn, source.mc, source.teacher.mc if source.teacher else None)
    rejected: list[dict[str, str]] = [{"layout": m, "reason": r} for m, r in rejected_meshes]
    pending: list[tuple[float, Layout, StageCosts, CostContext]] = []
    accepts = TrainerCheck(cfg, world)
    work = [(dims, list(batch_cuts(budget, dims.dp, opts.max_microbatches))) for dims in valid]
    pairs = sum(len(cuts) for _, cuts in work)
    logger.info(
        "phase 2/5: costing layouts: %d meshes (%d rejected) x batch cuts = %d (mesh, cut) pairs",
        len(valid), len(rejected_meshes), pairs,
    )  # fmt: skip
    with Progress(pairs, "plan: cost layouts", "cut", logger=logger) as bar:
        for dims, cuts in work:
            if not cuts:
                rejected.append({"layout": f"pp={dims.pp} tp={dims.tp} dp={dims.dp}",
                                 "reason": f"the global batch ({budget.total}) has no cut over dp={dims.dp}"})  # fmt: skip
            mesh = f"pp={dims.pp} tp={dims.tp} dp={dims.dp}" + (f" ep={dims.ep}" if dims.ep > 1 else "")
            for m, g, mb in cuts:
                shape = source.shape(mb, m, g, dims.dp, budget.token_mode)
                fetch = source.fetch_s.get((mb, m, g, dims.dp, int(budget.token_mode)), 0.0)
                cut_ctx = replace(ctx, fetch_s_per_microbatch=fetch)
                cut_ctx.teacher = source.teacher_blocks(shape, dims.tp, dims.ep, cut_ctx)
                for layout in _layouts(dims, m, g, mb, budget.token_mode, source, shape, cut_ctx, rejected):
                    error = accepts(layout)
                    if error:
                        rejected.append(
                            {"layout": describe(layout), "reason": f"trainer rejects it: {error}"}
                        )
                        continue
                    costs = source.block_costs(shape, layout.remat, layout.tp, cut_ctx, layout.ep)
                    sc = layout_stage_costs(layout, costs, shape, cut_ctx)
                    pending.append((lower_bound(layout, sc, cut_ctx), layout, sc, cut_ctx))
                bar.update(1, mesh=mesh, layouts=len(pending), measured=source.measured)
    return pending, rejected


def _simulate_best(
    pending: list[tuple[float, Layout, StageCosts, CostContext]], memory_gib: float | None,
    opts: PlanOptions, rejected: list[dict[str, str]],
) -> tuple[list[Candidate], int]:  # fmt: skip
    """Simulate in lower-bound order until no remaining layout can enter the best `opts.keep`."""
    limit = memory_gib * GIB * opts.memory_headroom if memory_gib else None
    best: list[float] = []  # max-heap (negated) of the keep best fitting step times
    out: list[Candidate] = []
    pruned = 0
    logger.info(
        "phase 4/5: simulating %d layouts, best lower bound first (the best %d kept)", len(pending), opts.keep
    )
    bar = Progress(len(pending), "plan: simulate", "layout", logger=logger)
    for bound, layout, sc, ctx in sorted(pending, key=lambda x: x[0]):
        bar.update(1, fitting=len(out), pruned=pruned)
        if len(best) >= opts.keep and bound > -best[0]:
            pruned += 1
            continue
        pred = predict_step(layout, sc, ctx)
        if limit is not None and pred.peak_memory_bytes > limit:
            what = "at start-up" if pred.startup_memory_bytes >= pred.peak_memory_bytes else "per rank"
            rejected.append({"layout": describe(layout), "reason": (
                f"does not fit: needs {pred.peak_memory_bytes / GIB:.1f} GiB {what} > "
                f"{opts.memory_headroom:.0%} of {memory_gib:g} GiB")})  # fmt: skip
            continue
        out.append(Candidate(layout, pred, []))
        heapq.heappush(best, -pred.step_time_s)
        if len(best) > opts.keep:
            heapq.heappop(best)
    bar.close()
    out.sort(key=lambda c: (c.prediction.step_time_s, c.prediction.peak_memory_bytes))
    return out, pruned


def cost_context(
    cfg: JobConfig, opts: PlanOptions, source: CostSource, device: DeviceSpec | None
) -> CostContext:
    """The cost model's context: links, optimizer speed, and the memory model's host terms
    (the process baseline when costing this host's CPU)."""
    on_host_cpu = device is None and not torch.cuda.is_available()
    baseline = HOST_BASELINE_BYTES if on_host_cpu else 0.0
    return CostContext(
        source.mc, device.link if device else _local_link(opts), opts.gpus_per_node or opts.world_size,
        cfg.training.half_precision, cfg.parallel.sequence_parallel,
        28.0 / device.hbm_bytes_per_s if device else measure_optimizer_s_per_param(source.mc),
        host_baseline_bytes=baseline if opts.host_baseline_gib is None else opts.host_baseline_gib * GIB,
        host_cpu=on_host_cpu,
    )  # fmt: skip


def predict_config(cfg: JobConfig, base_args: list[str], opts: PlanOptions) -> Candidate | str:
    """The prediction for the config's own layout alone (no search, no calibration), or why it cannot run."""
    device = device_spec(opts.device, cfg.training.half_precision) if opts.device else None
    source = CostSource(cfg, opts, device)
    ctx = cost_context(cfg, opts, source, device)
    return own_layout(cfg, base_args, source, ctx, opts.world_size, opts.gpus_per_node or opts.world_size)


class TrainerCheck:
    """`trainer.run.preflight.validate_early` on a layout, as the trainer would see its flags.

    The config is the job's with the layout's fields replaced (the dataclasses re-run their
    own checks); the mesh and schedule part is checked once per (mesh, m, g, schedule, v),
    the balance by `validate_balance`, which is what validate_early runs on it.
    """

    def __init__(self, cfg: JobConfig, world: int) -> None:
        self.cfg, self.world = cfg, world
        self._seen: dict[tuple[Any, ...], str] = {}

    def __call__(self, layout: Layout) -> str:
        """The trainer's error message for `layout`, or "" when it accepts it."""
        from parallel.pipeline.partition import validate_balance
        from trainer.run.preflight import validate_early

        key = (
            layout.pp,
            layout.tp,
            layout.dp,
            layout.m,
            layout.g,
            layout.microbatch,
            layout.schedule,
            layout.v,
            layout.sharding,
            layout.ep,
        )
        if key not in self._seen:
            try:
                validate_early(self._config(layout), self.world)
                self._seen[key] = ""
            except BAD_INPUT as e:
                self._seen[key] = str(e)
        if self._seen[key] or len(layout.balance) < 2:
            return self._seen[key]
        try:
            validate_balance(list(layout.balance), sum(layout.balance), layout.pp * layout.v)
        except BAD_INPUT as e:
            return str(e)
        return ""

    def _config(self, layout: Layout) -> JobConfig:
        """The job's config with `layout_fields` (what `layout_args` writes as flags) in place, its
        balance left to `validate_balance` (the partition is checked apart, per balance)."""
        c = self.cfg
        values = layout_fields(layout, c.parallel.sequence_parallel)
        values["partition_method"] = "uniform"

        def take(section: Any) -> Any:  # the section with its fields in `values` replaced
            return replace(
                section, **{k: v for k, v in values.items() if k in {f.name for f in fields(section)}}
            )

        return replace(c, parallel=take(c.parallel), training=take(c.training), data=take(c.data))


def _own_cut(cfg: JobConfig, world: int) -> tuple[int, int, int, int, bool]:
    """(micro-batch, m, g, dp, token mode) of the config's own layout (dp=1 if it does not fit)."""
    try:
        dp = parallel_dims(cfg.parallel, world, local_world_size=world).validate().dp
    except ParallelConfigError:
        dp = 1
    token = bool(cfg.data.max_tokens_per_microbatch)
    mb = int(cfg.data.max_tokens_per_microbatch or 0) if token else cfg.training.per_device_train_batch_size
    return mb, cfg.parallel.num_microbatches, cfg.training.gradient_accumulation_steps, dp, token


def _local_link(opts: PlanOptions) -> LinkModel:
    if opts.link_gbps:
        lat = opts.link_latency_us * 1e-6
        return LinkModel(lat, opts.link_gbps * 1e9, lat, (opts.inter_node_gbps or opts.link_gbps) * 1e9)
    logger.info("measuring the link: ping-pong between two local gloo processes (--link_gbps skips it)")
    return measure_link()


def _layouts(
    dims: ParallelDims, m: int, g: int, mb: int, token_mode: bool, source: CostSource,
    shape: Shape, ctx: CostContext, rejected: list[dict[str, str]],
) -> Iterator[Layout]:  # fmt: skip
    """Schedules x remat x partitions x dp sharding of one mesh and batch cut, distinct balances only."""
    schedules = schedule_space() if dims.pp > 1 else [("1f1b", 1)]  # one stage: the schedules coincide
    params, _ = block_param_counts(source.mc, dims.tp, dims.ep)
    for schedule, v in schedules:
        if source.opts.schedules and schedule not in source.opts.schedules:
            continue
        for remat in source.opts.remat or REMAT_SPACE:
            costs = source.block_costs(shape, remat, dims.tp, ctx, dims.ep)
            seen: set[tuple[int, ...]] = set()
            for method in PARTITION_SPACE if dims.pp * v > 1 else ("uniform",):
                base = Layout(dims.pp, dims.tp, dims.dp, m, g, mb, schedule, v, remat, method, (), token_mode,
                              ep=dims.ep)  # fmt: skip
                try:
                    balance = tuple(balance_from_costs(method, costs, params, dims.pp * v))
                except ParallelConfigError as e:
                    rejected.append({"layout": describe(base), "reason": str(e)})
                    break
                if balance not in seen:
                    seen.add(balance)
                    for sharding in sharding_space(dims.dp, source.opts.sharding):
                        yield replace(base, balance=balance, sharding=sharding)


def own_layout(
    cfg: JobConfig, base_args: list[str], source: CostSource, ctx: CostContext, world: int, gpn: int,
    fits: dict[Family, Calibration] | None = None,
) -> Candidate | str:  # fmt: skip
    """The config's own layout, predicted the same way (or why it cannot run on this world)."""
    p = cfg.parallel
    from trainer.run.distill import check_mesh

    try:
        dims = parallel_dims(p, world, local_world_size=gpn)
        check_mesh(dims, source.mc, source.teacher.mc if source.teacher else None)
    except ParallelConfigError as e:
        return str(e)
    token = bool(cfg.data.max_tokens_per_microbatch)
    mb = int(cfg.data.max_tokens_per_microbatch or 0) if token else cfg.training.per_device_train_batch_size
    m, g, v = p.num_microbatches, cfg.training.gradient_accumulation_steps, p.virtual_stages
    shape = source.shape(mb, m, g, dims.dp, token)
    fetch = source.fetch_s.get((mb, m, g, dims.dp, int(token)), 0.0)
    ctx = replace(ctx, fetch_s_per_microbatch=fetch)
    ctx.teacher = source.teacher_blocks(shape, dims.tp, dims.ep, ctx)
    costs = source.block_costs(shape, p.activation_checkpointing, dims.tp, ctx, dims.ep)
    params, _ = block_param_counts(source.mc, dims.tp, dims.ep)
    try:
        balance = p.partition_balance() or balance_from_costs(p.partition_method, costs, params, dims.pp * v)
        layout = Layout(dims.pp, dims.tp, dims.dp, m, g, mb, p.pipeline_schedule, v,
                        p.activation_checkpointing, p.partition_method, tuple(balance), token,
                        p.data_parallel_sharding, dims.ep)  # fmt: skip
        [(_, _, sc, lay_ctx)] = apply(
            [(0.0, layout, layout_stage_costs(layout, costs, shape, ctx), ctx)], fits or {}
        )
        return Candidate(layout, predict_step(layout, sc, lay_ctx), list(base_args))
    except BAD_INPUT as e:
        return str(e)
