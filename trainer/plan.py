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
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from models.config import ModelConfig
from models.m2m100 import BlockKind
from parallel.mesh import ParallelDims
from parallel.profile import BlockPhases
from parallel.simulate import StageCosts
from trainer.config import SCHEDULE_CHOICES, ConfigError, JobConfig, parse_config
from trainer.plan_cost import (
    GIB,
    CostContext,
    DeviceSpec,
    KindCosts,
    Layout,
    LinkModel,
    Prediction,
    Shape,
    block_costs,
    block_param_counts,
    choose_balance,
    device_spec,
    lower_bound,
    measure_kind_costs,
    measure_link,
    measure_optimizer_s_per_param,
    predict,
    stage_costs,
    table_kind_costs,
    tp_shape,
)

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


@dataclass
class Candidate:
    layout: Layout
    prediction: Prediction
    args: list[str]


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


# ----------------------------------------------------------------------------- shapes and costs


class CostSource:
    """Micro-batch shapes (from the data, or a fixed length) and per-kind costs, cached."""

    def __init__(self, cfg: JobConfig, opts: argparse.Namespace, device: DeviceSpec | None) -> None:
        self.cfg, self.opts, self.device = cfg, opts, device
        self.sampler_data: Any = None
        self.mc = self._load(cfg, opts)
        self.fetch_s: dict[tuple[int, ...], float] = {}
        self._shapes: dict[tuple[int, ...], Shape] = {}
        self._costs: dict[tuple[Shape, str], KindCosts] = {}
        self._acts: dict[tuple[int, int, str], dict[BlockKind, int]] = {}

    def _load(self, cfg: JobConfig, opts: argparse.Namespace) -> ModelConfig:
        """The architecture; with data at hand (and no --seq_len), its tokenizer's vocabulary too."""
        if opts.seq_len is None:
            try:
                return self._load_data(cfg)
            except (OSError, ValueError) as e:
                logger.warning("data not loadable (%s): shapes from max_source/target_length", e)
        if cfg.model.model_name_or_path:
            from models.hf import read_hf_config

            return read_hf_config(cfg.model.model_name_or_path)
        return cfg.model.model_config(cfg.model.vocab_size, {})

    def _load_data(self, cfg: JobConfig) -> ModelConfig:
        from trainer.data import load_raw_datasets, run_languages, tokenize_datasets, training_texts
        from trainer.tokenizer import load_or_train_tokenizer
        from trainer.train import model_config_for

        d, m = cfg.data, cfg.model
        raw = load_raw_datasets(d, cfg.training.seed)
        tok = load_or_train_tokenizer(
            m.tokenizer_name, run_languages(d), training_texts(raw.train), m.vocab_size,
            d.spm_model_type, d.spm_character_coverage, d.spm_input_sentence_size, cfg.training.seed,
        )  # fmt: skip
        self.sampler_data = (tokenize_datasets(raw, tok, d).train, tok)
        return model_config_for(cfg, tok)

    def shape(self, mb: int, m: int, g: int, dp: int, token_mode: bool) -> Shape:
        """Mean micro-batch of this batch cut: from the data's first global batches, else fixed length."""
        key = (mb, m, g, dp, int(token_mode))
        if key not in self._shapes:
            self._shapes[key] = (
                self._data_shape(key) if self.sampler_data else self._fixed_shape(mb, token_mode)
            )
        return self._shapes[key]

    def _fixed_shape(self, mb: int, token_mode: bool) -> Shape:
        d = self.cfg.data
        length = self.opts.seq_len or max(d.max_source_length, d.max_target_length)
        return Shape(max(1, mb // length) if token_mode else mb, length, length)

    def _data_shape(self, key: tuple[int, ...]) -> Shape:
        import time

        import numpy as np

        from trainer.data import BatchLayout, GlobalBatchSampler

        mb, m, g, dp, token_mode = key
        train, tok = self.sampler_data
        layout = BatchLayout(1 if token_mode else mb, m, g, dp, mb if token_mode else None)
        sampler = GlobalBatchSampler(train, layout, self.cfg.training.seed, tok.pad_id,
                                     tok.special_ids()["decoder_start_token_id"])  # fmt: skip
        rows, src, tgt, fetch = [], [], [], []
        for _ in range(8):
            gb = next(sampler)
            for flush in gb.replica_slots(0):
                for idx in flush:
                    rows.append(len(idx))
                    src.append(int(sampler.src_len[idx].max()))
                    tgt.append(int(sampler.tgt_len[idx].max()))
            t0 = time.perf_counter()
            gb.shard(0)
            fetch.append((time.perf_counter() - t0) / (m * g))
        self.fetch_s[key] = statistics.median(fetch)
        return Shape(
            max(1, round(float(np.mean(rows)))), round(float(np.mean(src))), round(float(np.mean(tgt)))
        )

    def kind_costs(self, shape: Shape, remat: str) -> KindCosts:
        """Per-kind costs of one micro-batch under `remat` ("stage" is costed as "none" here)."""
        remat = "none" if remat == "stage" else remat
        key = (shape, remat)
        if key not in self._costs:
            bf16 = self.cfg.training.bf16
            if self.device is None:
                self._costs[key] = measure_kind_costs(self.mc, shape, remat, bf16, self.opts.repeats)
            else:
                one = self._one_sentence_bytes(shape.s, shape.t, remat)
                scale = shape.b * (0.5 if bf16 else 1.0)  # bf16 keeps 2-byte activations
                acts = {k: int(n * scale) for k, n in one.items()}
                self._costs[key] = table_kind_costs(self.mc, shape, remat, self.device, acts)
        return self._costs[key]

    def _one_sentence_bytes(self, s: int, t: int, remat: str) -> dict[BlockKind, int]:
        """Activation bytes per block kind of one sentence, measured here in fp32 (table mode)."""
        key = (s, t, remat)
        if key not in self._acts:
            one = measure_kind_costs(self.mc, Shape(1, s, t), remat, bf16=False, timed=False)
            self._acts[key] = {k: ph.activation_bytes for k, ph in one.items()}
        return self._acts[key]

    def block_costs(self, shape: Shape, remat: str, tp: int, ctx: CostContext) -> list[BlockPhases]:
        """Every block's costs on one tp rank (`plan_cost.block_costs`)."""
        rank_shape, factor = tp_shape(shape, tp)
        kinds = self.kind_costs(shape, remat)
        return block_costs(kinds, self.kind_costs(rank_shape, remat), factor, self.mc, shape, tp, ctx)


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
                    rejected.append({"layout": _describe(layout), "reason": f"trainer rejects it: {error}"})
                    continue
                sc = stage_costs(
                    layout, source.block_costs(shape, layout.remat, layout.tp, cut_ctx), shape, cut_ctx
                )
                pending.append((lower_bound(layout, sc, cut_ctx), layout, sc, cut_ctx))
    candidates, pruned = _simulate_best(pending, memory_gib, opts, rejected)
    for c in candidates[: opts.top]:  # the printed rows: their flags through the trainer's own parser
        c.args = layout_args(c.layout, base_args)
        check_args(c.args, world)
    for c in candidates[opts.top :]:
        c.args = layout_args(c.layout, base_args)
    own = own_layout(cfg, base_args, source, ctx, world, gpn)
    return _report(cfg, opts, device, link, memory_gib, candidates, rejected, pruned, own)


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
            rejected.append({"layout": _describe(layout), "reason": (
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
                    rejected.append({"layout": _describe(base), "reason": str(e)})
                    break
                if balance not in seen:
                    seen.add(balance)
                    yield replace(base, balance=balance)


def _describe(layout: Layout) -> str:
    mb = f"{layout.microbatch} tok" if layout.token_mode else f"b={layout.microbatch}"
    return (
        f"pp={layout.pp} tp={layout.tp} dp={layout.dp} m={layout.m} g={layout.g} {mb} "
        f"{layout.schedule}(v={layout.v}) remat={layout.remat} partition={layout.partition}"
    )


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


def _report(
    cfg: JobConfig, opts: argparse.Namespace, device: DeviceSpec | None, link: LinkModel,
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
                                   "optimizer": p.optimizer_s, "data": p.data_s, "p2p_message": p.link_s},
        "predicted_memory_bytes": p.memory,
        "predicted_peak_activation_bytes_per_pp_rank": p.peak_activation_bytes_per_pp_rank,
        "parameters_per_pp_rank": p.params_per_pp_rank,
        "reason": _reason(c, best, memory_gib) if best else "",
    }  # fmt: skip


def own_layout(
    cfg: JobConfig, base_args: list[str], source: CostSource, ctx: CostContext, world: int, gpn: int
) -> Candidate | str:
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
        return Candidate(
            layout, predict(layout, stage_costs(layout, costs, shape, ctx), ctx), list(base_args)
        )
    except ValueError as e:
        return str(e)


def _reason_kind(reason: str) -> str:
    return reason.split(":")[0] if reason.startswith(("does not fit", "trainer rejects")) else reason[:60]


# ----------------------------------------------------------------------------- printing, validation


def format_table(result: dict[str, Any], top: int) -> str:
    """The ranked candidates (first `top`) and the rejection counts, as text."""
    lines = [
        f"plan for {result['config']} on {result['world_size']} ranks ({result['gpus_per_node']} per node), "
        f"costs {result['costs']}",
        f"{'#':>3} {'pp':>2} {'tp':>2} {'dp':>2} {'m':>3} {'g':>2} {'mb':>5}  {'schedule':<19} {'remat':<9} "
        f"{'partition':<10} {'step s':>9} {'bubble':>6} {'peak GiB':>8}  why",
    ]
    for row in result["candidates"][:top]:
        lay = row["layout"]
        sched = f"{lay['schedule']}" + (f" v={lay['v']}" if lay["v"] > 1 else "")
        lines.append(
            f"{row['rank']:>3} {lay['pp']:>2} {lay['tp']:>2} {lay['dp']:>2} {lay['m']:>3} {lay['g']:>2} "
            f"{lay['microbatch']:>5}  {sched:<19} {lay['remat']:<9} {lay['partition']:<10} "
            f"{row['predicted_step_time_s']:>9.4g} {row['predicted_bubble_fraction']:>6.1%} "
            f"{row['predicted_peak_memory_bytes'] / GIB:>8.2f}  {row['reason']}"
        )
    own = result["config_layout"]
    if "error" in own:
        lines.append(f"the config's own layout cannot run here: {own['error']}")
    else:
        lay = own["layout"]
        lines.append(
            f"the config's own layout (pp={lay['pp']} tp={lay['tp']} dp={lay['dp']} m={lay['m']} "
            f"{lay['schedule']} v={lay['v']} remat={lay['remat']}) would rank #{own['rank']}: "
            f"{own['predicted_step_time_s']:.4g} s/step, bubble {own['predicted_bubble_fraction']:.1%}, "
            f"{own['predicted_peak_memory_bytes'] / GIB:.2f} GiB"
        )
    lines.append(
        f"{len(result['candidates'])} layouts fit; {result['pruned']} not simulated (their lower bound is "
        f"slower than the best kept); rejected: {result['rejected_counts'] or 'none'}"
    )
    return "\n".join(lines)


def validate(result: dict[str, Any], k: int, opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the top `k` candidates with trainer.train; predicted vs measured step time and memory.

    Step time: the median `step_time_s` of metrics.jsonl after `opts.validate_warmup` steps.
    Memory: the largest `peak_activation_bytes_stage_*` (the executor's meter) against the
    predicted peak activations of the most loaded pp rank.
    """
    out = []
    root = Path(opts.validate_dir or tempfile.mkdtemp(prefix="plan_validate_"))
    for row in result["candidates"][:k]:
        run_dir = root / f"candidate_{row['rank']}"
        measured = run_candidate(row["args"], opts.world_size, run_dir, opts)
        pred = row["predicted_step_time_s"]
        act = max(row["predicted_peak_activation_bytes_per_pp_rank"])
        out.append({
            "rank": row["rank"], "predicted_step_time_s": pred, "measured_step_time_s": measured["step_time_s"],
            "step_time_error": measured["step_time_s"] / pred - 1,
            "predicted_peak_activation_bytes": act,
            "measured_peak_activation_bytes": measured["peak_activation_bytes"], "output_dir": str(run_dir),
        })  # fmt: skip
    return out


def run_candidate(args: list[str], world: int, out_dir: Path, opts: argparse.Namespace) -> dict[str, float]:
    """Train `args` for `opts.validate_steps` steps into `out_dir`; its median step time and peak.

    Raises:
        RuntimeError: the run failed or timed out (its stderr's tail in the message).
    """
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [*(launcher if world > 1 else [sys.executable]), "-m", "trainer.train", *args,
           "--output_dir", str(out_dir), "--overwrite_output_dir", "true",
           "--max_steps", str(opts.validate_steps), "--logging_steps", "1", "--do_eval", "false",
           "--save_steps", "0", "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=opts.validate_timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"validation run timed out after {opts.validate_timeout} s: {' '.join(cmd)}"
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(f"validation run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "step_time_s" in r][opts.validate_warmup :]
    if not steps:
        raise RuntimeError(
            f"no step rows after {opts.validate_warmup} warm-up steps in {out_dir}/metrics.jsonl"
        )
    peak = max(v for r in steps for key, v in r.items() if key.startswith("peak_activation_bytes_stage_"))
    return {"step_time_s": statistics.median(r["step_time_s"] for r in steps), "peak_activation_bytes": peak}


def format_validation(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'#':>3} {'predicted s':>11} {'measured s':>10} {'error':>7} {'act MiB pred':>12} {'act MiB meas':>12}"
    ]
    for r in rows:
        lines.append(
            f"{r['rank']:>3} {r['predicted_step_time_s']:>11.4g} {r['measured_step_time_s']:>10.4g} "
            f"{r['step_time_error']:>+7.1%} {r['predicted_peak_activation_bytes'] / 2**20:>12.2f} "
            f"{r['measured_peak_activation_bytes'] / 2**20:>12.2f}"
        )
    if rows:
        best = min(rows, key=lambda r: r["measured_step_time_s"])
        lines.append(
            f"measured best: #{best['rank']}; predicted best #1 is "
            f"{rows[0]['measured_step_time_s'] / best['measured_step_time_s'] - 1:+.1%} from it"
        )
    return "\n".join(lines)


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
    ap.add_argument("--validate_steps", type=int, default=12)
    ap.add_argument("--validate_warmup", type=int, default=3)
    ap.add_argument("--validate_timeout", type=float, default=600)
    ap.add_argument("--validate_dir", default=None, help="Output dirs of the validation runs.")
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
    for name in ("world_size", "top", "keep", "max_microbatches", "repeats", "validate_steps"):
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
