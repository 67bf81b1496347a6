"""`python -m trainer.plan`: rank the layouts a job can run with, by predicted step time and memory.

    python -m trainer.plan --config configs/tiny.yaml --world_size 2 [--gpus_per_node G]
        [--device_memory_gib M] [--device H100] [--top K] [--output plan.json]
        [--validate K] [--field value ...]          (config overrides, as in trainer.train)

    enumerate   meshes (pp, tp, dp) that `ParallelDims` accepts for the world and node size;
                cuts of the config's global batch (micro-batch x m x g x dp = const);
                schedules x virtual stages (`SCHEDULE_SPACE`), remat policies, partitions;
                each candidate's trainer flags must pass `trainer.train.validate_early`
    cost        `trainer.plan_cost`: per-block costs measured here (or from a device
                table), the simulator on the schedule's action lists, a link model
    calibrate   where the world runs here: one short trainer run per mesh and backward kind
                fits a compute scale and step offset (`trainer.plan_calibrate`)
    rank        drop what does not fit in device memory; best predicted step first
    validate    run the top K with trainer.train for a few steps; predicted vs measured

Everything rejected is listed with its reason (in plan.json and counted in the printout).
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from models.config import ModelConfig
from parallel.mesh import ParallelDims
from parallel.simulate import StageCosts
from trainer.config import SCHEDULE_CHOICES, ConfigError, JobConfig, parse_config
from trainer.plan_calibrate import Calibration, Family, apply, calibrate, should_calibrate
from trainer.plan_calibrate import report as calibration_rows
from trainer.plan_cost import (
    GIB,
    Candidate,
    CostContext,
    Layout,
    LinkModel,
    Shape,
    block_param_counts,
    choose_balance,
    device_spec,
    lower_bound,
    predict,
    stage_costs,
)
from trainer.plan_measure import CostSource, measure_link, measure_optimizer_s_per_param, measure_overheads
from trainer.plan_report import build_report, describe, format_table, format_validation, run_root, validate

logger = logging.getLogger("trainer.plan")

# The search space, as lists to extend: (schedule, virtual stages per rank); remat; partition.
SCHEDULE_SPACE: list[tuple[str, int]] = [
    ("1f1b", 1),
    ("gpipe", 1),
    ("interleaved_1f1b", 2),
    ("interleaved_1f1b", 4),
    ("zero_bubble", 1),
    ("zbv", 2),  # used only where the trainer and parallel.schedule.build_schedule accept it
]
REMAT_SPACE = ("none", "selective", "full", "stage")
PARTITION_SPACE = ("time", "uniform", "parameters", "memory")
MAX_ACCUMULATION = 8


@dataclass(frozen=True)
class Budget:
    """The global batch every layout must keep: sentences, or token cap x slots in token mode."""

    total: int
    token_mode: bool
    longest: int  # token mode: the smallest cap that holds the longest example


# ----------------------------------------------------------------------------- search space


def schedule_space() -> list[tuple[str, int]]:
    """`SCHEDULE_SPACE` less the schedules this checkout's trainer or schedule builder lacks."""
    from parallel.schedule import build_schedule

    out = []
    for name, v in SCHEDULE_SPACE:
        if name not in SCHEDULE_CHOICES:
            continue
        try:
            build_schedule(name, 2, 4, v)
        except ValueError:
            continue
        out.append((name, v))
    return out


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def meshes(
    world: int, gpus_per_node: int, arch: ModelConfig
) -> tuple[list[ParallelDims], list[tuple[str, str]]]:
    """Every (pp, tp, dp) with pp * tp * dp = world that `ParallelDims.validate` accepts.

    Returns:
        (valid dims, [(mesh, reason)] for the rejected ones).
    """
    valid, rejected = [], []
    for pp in divisors(world):
        for tp in divisors(world // pp):
            dims = ParallelDims(pp, world // (pp * tp), tp, world, local_world_size=gpus_per_node)
            try:
                valid.append(dims.validate(arch))
            except ValueError as e:
                rejected.append((f"pp={pp} tp={tp} dp={world // (pp * tp)}", str(e)))
    return valid, rejected


def batch_budget(cfg: JobConfig, world: int) -> Budget:
    """The config's global batch: per_device_train_batch_size (or the token cap) x m x g x dp.

    Raises:
        ConfigError: the config's own mesh does not fit `world`, so its global batch is undefined.
    """
    p, t = cfg.parallel, cfg.training
    try:
        dp0 = ParallelDims.from_args(p, world, local_world_size=world).validate().dp
    except ValueError as e:
        raise ConfigError(f"the config's mesh does not fit --world_size {world}: {e}") from None
    slots = p.num_microbatches * t.gradient_accumulation_steps * dp0
    cap = cfg.data.max_tokens_per_microbatch
    if cap:
        return Budget(cap * slots, True, max(cfg.data.max_source_length, cfg.data.max_target_length))
    return Budget(t.per_device_train_batch_size * slots, False, 1)


def batch_cuts(budget: Budget, dp: int, max_m: int) -> Iterator[tuple[int, int, int]]:
    """(m, g, micro-batch) with micro-batch x m x g x dp = the budget (token caps >= the longest example)."""
    if budget.total % dp:
        return
    per_replica = budget.total // dp
    for m in divisors(per_replica):
        if m > max_m:
            break
        for g in divisors(per_replica // m):
            mb = per_replica // (m * g)
            if g <= MAX_ACCUMULATION and mb >= budget.longest:
                yield m, g, mb


def layout_args(layout: Layout, base: list[str]) -> list[str]:
    """The trainer.train flags that run `layout` (after the config and the user's overrides)."""
    size = "--max_tokens_per_microbatch" if layout.token_mode else "--per_device_train_batch_size"
    balance = ",".join(str(b) for b in layout.balance) if len(layout.balance) > 1 else "uniform"
    return [
        *base,
        "--pipeline_parallel_size", str(layout.pp),
        "--tensor_parallel_size", str(layout.tp),
        "--data_parallel_size", str(layout.dp),
        "--num_microbatches", str(layout.m),
        "--gradient_accumulation_steps", str(layout.g),
        size, str(layout.microbatch),
        "--pipeline_schedule", layout.schedule,
        "--virtual_pipeline_stages", str(max(layout.v, 2)),
        "--activation_checkpointing", layout.remat,
        "--partition_method", balance,
    ]  # fmt: skip


def check_args(args: list[str], world: int) -> JobConfig:
    """Parse the candidate's flags as trainer.train does and run its early validation.

    Raises:
        ValueError: whatever `parse_config` or `validate_early` reject.
    """
    from trainer.train import validate_early

    cfg = parse_config(list(args))
    validate_early(cfg, world)
    return cfg


# ----------------------------------------------------------------------------- the search


def plan(cfg: JobConfig, base_args: list[str], opts: argparse.Namespace) -> dict[str, Any]:
    """Enumerate, predict, filter and rank; returns what plan.json holds.

    Candidates are simulated in order of their lower bound (`plan_cost.lower_bound`); once
    `opts.keep` fitting candidates are known, one whose bound exceeds the keep-th best
    prediction cannot enter the table and is counted as pruned instead of simulated.
    """
    world, gpn = opts.world_size, opts.gpus_per_node or opts.world_size
    device = device_spec(opts.device, cfg.training.bf16) if opts.device else None
    source = CostSource(cfg, opts, device)
    link = device.link if device else _local_link(opts)
    memory_gib = opts.device_memory_gib or (device.memory_gib if device else None)
    ctx = CostContext(
        source.mc, link, gpn, cfg.training.bf16, cfg.parallel.data_parallel_sharding == "zero1",
        cfg.parallel.sequence_parallel,
        28.0 / device.hbm_bytes_per_s if device else measure_optimizer_s_per_param(source.mc),
    )  # fmt: skip
    calibrating, why_not = should_calibrate(opts, measured_here=device is None)
    if device is None and not calibrating:  # what the block profile misses, on a one-rank mesh
        logger.info("no calibration runs (%s): executor overheads from a one-rank run", why_not)
        shape0 = source.shape(*_own_cut(cfg, world))
        ctx.action_overhead_s, ctx.step_overhead_s = measure_overheads(
            cfg, source.mc, shape0, source.kind_costs(shape0, "none"), ctx.optimizer_s_per_param
        )
    budget = batch_budget(cfg, world)
    valid, rejected_meshes = meshes(world, gpn, source.mc)
    rejected: list[dict[str, str]] = [{"layout": m, "reason": r} for m, r in rejected_meshes]
    pending: list[tuple[float, Layout, StageCosts, CostContext]] = []
    accepts = TrainerCheck(cfg, world)
    for dims in valid:
        cuts = list(batch_cuts(budget, dims.dp, opts.max_microbatches))
        if not cuts:
            rejected.append({"layout": f"pp={dims.pp} tp={dims.tp} dp={dims.dp}",
                             "reason": f"the global batch ({budget.total}) has no cut over dp={dims.dp}"})  # fmt: skip
        for m, g, mb in cuts:
            shape = source.shape(mb, m, g, dims.dp, budget.token_mode)
            fetch = source.fetch_s.get((mb, m, g, dims.dp, int(budget.token_mode)), 0.0)
            cut_ctx = replace(ctx, fetch_s_per_microbatch=fetch)
            for layout in _layouts(dims, m, g, mb, budget.token_mode, source, shape, cut_ctx, rejected):
                error = accepts(layout)
                if error:
                    rejected.append({"layout": describe(layout), "reason": f"trainer rejects it: {error}"})
                    continue
                sc = stage_costs(
                    layout, source.block_costs(shape, layout.remat, layout.tp, cut_ctx), shape, cut_ctx
                )
                pending.append((lower_bound(layout, sc, cut_ctx), layout, sc, cut_ctx))
    fits = calibrate(pending, base_args, opts, run_root(opts, "calibrate")) if calibrating else {}
    candidates, pruned = _simulate_best(apply(pending, fits), memory_gib, opts, rejected)
    for c in candidates[: opts.top]:  # the printed rows: their flags through the trainer's own parser
        c.args = layout_args(c.layout, base_args)
        check_args(c.args, world)
    for c in candidates[opts.top :]:
        c.args = layout_args(c.layout, base_args)
    own = own_layout(cfg, base_args, source, ctx, world, gpn, fits)
    result = build_report(cfg, opts, device, link, memory_gib, candidates, rejected, pruned, own)
    result["calibration"] = calibration_rows(fits) if calibrating else why_not
    return result


def _simulate_best(
    pending: list[tuple[float, Layout, StageCosts, CostContext]], memory_gib: float | None,
    opts: argparse.Namespace, rejected: list[dict[str, str]],
) -> tuple[list[Candidate], int]:  # fmt: skip
    """Simulate in lower-bound order until no remaining layout can enter the best `opts.keep`."""
    limit = memory_gib * GIB * opts.memory_headroom if memory_gib else None
    best: list[float] = []  # max-heap (negated) of the keep best fitting step times
    out: list[Candidate] = []
    pruned = 0
    for bound, layout, sc, ctx in sorted(pending, key=lambda x: x[0]):
        if len(best) >= opts.keep and bound > -best[0]:
            pruned += 1
            continue
        pred = predict(layout, sc, ctx)
        if limit is not None and pred.peak_memory_bytes > limit:
            rejected.append({"layout": describe(layout), "reason": (
                f"does not fit: needs {pred.peak_memory_bytes / GIB:.1f} GiB per rank > "
                f"{opts.memory_headroom:.0%} of {memory_gib:g} GiB")})  # fmt: skip
            continue
        out.append(Candidate(layout, pred, []))
        heapq.heappush(best, -pred.step_time_s)
        if len(best) > opts.keep:
            heapq.heappop(best)
    out.sort(key=lambda c: (c.prediction.step_time_s, c.prediction.peak_memory_bytes))
    return out, pruned


class TrainerCheck:
    """`trainer.train.validate_early` on a layout, as the trainer would see its flags.

    The config is the job's with the layout's fields replaced (the dataclasses re-run their
    own checks); the mesh and schedule part is checked once per (mesh, m, g, schedule, v),
    the balance by `validate_balance`, which is what validate_early runs on it.
    """

    def __init__(self, cfg: JobConfig, world: int) -> None:
        self.cfg, self.world = cfg, world
        self._seen: dict[tuple[Any, ...], str] = {}

    def __call__(self, layout: Layout) -> str:
        """The trainer's error message for `layout`, or "" when it accepts it."""
        from parallel.partition import validate_balance
        from trainer.train import validate_early

        key = (
            layout.pp,
            layout.tp,
            layout.dp,
            layout.m,
            layout.g,
            layout.microbatch,
            layout.schedule,
            layout.v,
        )
        if key not in self._seen:
            try:
                validate_early(self._config(layout), self.world)
                self._seen[key] = ""
            except ValueError as e:
                self._seen[key] = str(e)
        if self._seen[key] or len(layout.balance) < 2:
            return self._seen[key]
        try:
            validate_balance(list(layout.balance), sum(layout.balance), layout.pp * layout.v)
        except ValueError as e:
            return str(e)
        return ""

    def _config(self, layout: Layout) -> JobConfig:
        c = self.cfg
        parallel = replace(
            c.parallel, pipeline_parallel_size=layout.pp, tensor_parallel_size=layout.tp,
            data_parallel_size=layout.dp, num_microbatches=layout.m, pipeline_schedule=layout.schedule,
            virtual_pipeline_stages=max(layout.v, 2), partition_method="uniform",
        )  # fmt: skip
        b = c.training.per_device_train_batch_size if layout.token_mode else layout.microbatch
        training = replace(c.training, gradient_accumulation_steps=layout.g, per_device_train_batch_size=b)
        data = replace(c.data, max_tokens_per_microbatch=layout.microbatch) if layout.token_mode else c.data
        return replace(c, parallel=parallel, training=training, data=data)


def _own_cut(cfg: JobConfig, world: int) -> tuple[int, int, int, int, bool]:
    """(micro-batch, m, g, dp, token mode) of the config's own layout (dp=1 if it does not fit)."""
    try:
        dp = ParallelDims.from_args(cfg.parallel, world, local_world_size=world).validate().dp
    except ValueError:
        dp = 1
    token = bool(cfg.data.max_tokens_per_microbatch)
    mb = int(cfg.data.max_tokens_per_microbatch or 0) if token else cfg.training.per_device_train_batch_size
    return mb, cfg.parallel.num_microbatches, cfg.training.gradient_accumulation_steps, dp, token


def _local_link(opts: argparse.Namespace) -> LinkModel:
    if opts.link_gbps:
        lat = opts.link_latency_us * 1e-6
        return LinkModel(lat, opts.link_gbps * 1e9, lat, (opts.inter_node_gbps or opts.link_gbps) * 1e9)
    return measure_link()


def _layouts(
    dims: ParallelDims, m: int, g: int, mb: int, token_mode: bool, source: CostSource,
    shape: Shape, ctx: CostContext, rejected: list[dict[str, str]],
) -> Iterator[Layout]:  # fmt: skip
    """Schedules x remat x partitions of one mesh and batch cut, distinct balances only."""
    schedules = schedule_space() if dims.pp > 1 else [("1f1b", 1)]  # one stage: the schedules coincide
    params, _ = block_param_counts(source.mc, dims.tp)
    for schedule, v in schedules:
        if source.opts.schedules and schedule not in source.opts.schedules:
            continue
        for remat in source.opts.remat or REMAT_SPACE:
            costs = source.block_costs(shape, remat, dims.tp, ctx)
            seen: set[tuple[int, ...]] = set()
            for method in PARTITION_SPACE if dims.pp * v > 1 else ("uniform",):
                base = Layout(dims.pp, dims.tp, dims.dp, m, g, mb, schedule, v, remat, method, (), token_mode)
                try:
                    balance = tuple(choose_balance(method, costs, params, dims.pp * v))
                except ValueError as e:
                    rejected.append({"layout": describe(base), "reason": str(e)})
                    break
                if balance not in seen:
                    seen.add(balance)
                    yield replace(base, balance=balance)


def own_layout(
    cfg: JobConfig, base_args: list[str], source: CostSource, ctx: CostContext, world: int, gpn: int,
    fits: dict[Family, Calibration] | None = None,
) -> Candidate | str:  # fmt: skip
    """The config's own layout, predicted the same way (or why it cannot run on this world)."""
    p = cfg.parallel
    try:
        dims = ParallelDims.from_args(p, world, local_world_size=gpn).validate(source.mc)
    except ValueError as e:
        return str(e)
    token = bool(cfg.data.max_tokens_per_microbatch)
    mb = int(cfg.data.max_tokens_per_microbatch or 0) if token else cfg.training.per_device_train_batch_size
    m, g, v = p.num_microbatches, cfg.training.gradient_accumulation_steps, p.virtual_stages
    shape = source.shape(mb, m, g, dims.dp, token)
    fetch = source.fetch_s.get((mb, m, g, dims.dp, int(token)), 0.0)
    ctx = replace(ctx, fetch_s_per_microbatch=fetch)
    costs = source.block_costs(shape, p.activation_checkpointing, dims.tp, ctx)
    params, _ = block_param_counts(source.mc, dims.tp)
    try:
        balance = p.partition_balance() or choose_balance(p.partition_method, costs, params, dims.pp * v)
        layout = Layout(dims.pp, dims.tp, dims.dp, m, g, mb, p.pipeline_schedule, v,
                        p.activation_checkpointing, p.partition_method, tuple(balance), token)  # fmt: skip
        [(_, _, sc, lay_ctx)] = apply(
            [(0.0, layout, stage_costs(layout, costs, shape, ctx), ctx)], fits or {}
        )
        return Candidate(layout, predict(layout, sc, lay_ctx), list(base_args))
    except ValueError as e:
        return str(e)


# ----------------------------------------------------------------------------- entry point


def _names(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The planner's flags, and the rest (config overrides, as trainer.train takes them)."""
    ap = argparse.ArgumentParser(prog="python -m trainer.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="The job's YAML/JSON config (as for trainer.train).")
    ap.add_argument("--world_size", type=int, required=True, help="Ranks (processes / GPUs) in all.")
    ap.add_argument("--gpus_per_node", type=int, default=None, help="Ranks per node; default: one node.")
    ap.add_argument("--device_memory_gib", type=float, default=None, help="Memory per rank; default: table.")
    ap.add_argument("--device", default=None, help="Cost another device from the table (H100, H200, A100).")
    ap.add_argument("--memory_headroom", type=float, default=0.9, help="Usable share of device memory.")
    ap.add_argument("--top", type=int, default=10, help="Candidates to print.")
    ap.add_argument("--output", default="plan.json", help="Where the ranked candidates are written.")
    ap.add_argument("--validate", type=int, default=0, help="Run the top K with trainer.train.")
    ap.add_argument("--validate_steps", type=int, default=24)
    ap.add_argument("--validate_warmup", type=int, default=4)
    ap.add_argument(
        "--validate_repeats", type=int, default=3, help="Runs per layout (median of their medians)."
    )
    ap.add_argument("--validate_timeout", type=float, default=600)
    ap.add_argument(
        "--validate_dir", default=None, help="Output dirs of the calibration and validation runs."
    )
    ap.add_argument(
        "--calibrate", choices=("auto", "true", "false"), default="auto",
        help="Fit each mesh's compute scale and step offset from one short trainer run (auto: when the "
        "world runs on this machine and costs are measured here). --validate_steps/_warmup apply.",
    )  # fmt: skip
    ap.add_argument("--seq_len", type=int, default=None, help="Fixed sentence length instead of the data's.")
    ap.add_argument("--max_microbatches", type=int, default=64)
    ap.add_argument("--keep", type=int, default=50, help="Fitting layouts simulated before pruning by bound.")
    ap.add_argument("--schedules", type=_names, default=None, help="Only these schedules (comma list).")
    ap.add_argument("--remat", type=_names, default=None, help="Only these remat policies (comma list).")
    ap.add_argument("--repeats", type=int, default=5, help="Timed repetitions per block.")
    ap.add_argument("--link_gbps", type=float, default=None, help="Skip the link measurement: GB/s.")
    ap.add_argument("--link_latency_us", type=float, default=50.0)
    ap.add_argument("--inter_node_gbps", type=float, default=None)
    opts, rest = ap.parse_known_args(argv)
    for name in (
        "world_size",
        "top",
        "keep",
        "max_microbatches",
        "repeats",
        "validate_steps",
        "validate_repeats",
    ):
        if getattr(opts, name) < 1:
            ap.error(f"--{name}={getattr(opts, name)} must be >= 1")
    for flag, given, known in (("schedules", opts.schedules, [n for n, _ in SCHEDULE_SPACE]),
                               ("remat", opts.remat, list(REMAT_SPACE))):  # fmt: skip
        bad = sorted(set(given or []) - set(known))
        if bad:
            ap.error(f"--{flag} {bad} unknown; choose from {known}")
    if opts.validate < 0 or opts.validate_warmup >= opts.validate_steps:
        ap.error("--validate must be >= 0 and --validate_warmup < --validate_steps")
    if opts.gpus_per_node is not None and (opts.gpus_per_node < 1 or opts.world_size % opts.gpus_per_node):
        ap.error(
            f"--gpus_per_node={opts.gpus_per_node} must be >= 1 and divide --world_size={opts.world_size}"
        )
    return opts, rest


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Plan, print, write plan.json; validate the top K when asked."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    opts, overrides = parse_args(argv)
    base_args = ["--config", opts.config, *overrides]
    cfg = parse_config(list(base_args))
    if opts.device is None:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = plan(cfg, base_args, opts)
    print(format_table(result, opts.top), flush=True)
    if opts.validate:
        result["validation"] = validate(result, opts.validate, opts)
        print(format_validation(result["validation"]), flush=True)
    Path(opts.output).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if os.environ.get("TRAINER_TRACEBACK"):
            raise
        print(f"error: {type(e).__name__}: {e} (TRAINER_TRACEBACK=1 for the traceback)", file=sys.stderr)
        sys.exit(2)
