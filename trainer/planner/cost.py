"""The planner's cost model: what one layout costs per step, in seconds and bytes per rank.

    kind costs       one micro-batch through each block kind (embeddings, encoder layer, norm,
                     decoder layer, head): F, B, I, W seconds and the activation bytes the
                     executor's meter counts. Measured on this machine by
                     `parallel.pipeline.profile.profile_block_phases` on a one-layer copy of the model
                     (`measure_kind_costs`), or for another device from FLOPs and a device
                     table (`table_kind_costs`; activation bytes still measured here, at one
                     sentence, and scaled by the micro-batch size)
    LinkModel        point-to-point and ring all-reduce times: latency + bytes / bandwidth,
                     intra- versus inter-node
    predict_step     a layout -> per-stage costs -> `parallel.pipeline.simulate` on the schedule's real
                     action lists (makespan, bubble, peak activation bytes per pp rank)
                     + data fetch + dp / tied-embedding reduces (fsdp: reduce-scatter and
                     parameter all-gathers; zero1: the updated parameters' broadcast)
                     + optimizer = step time; memory per rank and at start-up from
                     `trainer.planner.memory` (parameters, grads, AdamW state and what
                     `data_parallel_sharding` divides by dp, fsdp's gathered units,
                     activations, the step's transients, the host baseline)
                     + a distillation teacher's forward flushes and bytes (`trainer.planner.teacher`)

Tensor parallelism: a block's compute and activation bytes are measured on one rank's shard
(or, from the device table, its FLOPs divided by tp); its communication is modelled, Megatron's
all-reduces (2 per encoder layer, 3 per decoder layer, forward and backward, of (B, T, H)
activations) through the link model. Expert parallelism (NLLB-MoE, `trainer.planner.moe`): a
sparse layer's block pays its all-to-alls (dispatch and combine, forward and backward, and the
recomputed forward under full remat) over the ep group's link; a rank holds E / ep experts,
whose gradients reduce (and ZeRO-1 / FSDP shard) over edp = dp / ep. Legend: p = pp, m micro-batches, g accumulation flushes, v
stages per rank, b sentences per micro-batch, s / t padded source / target tokens.

The kind costs live in `trainer.planner.blocks`, the link model and device table in
`trainer.planner.hardware`, the layout in `trainer.planner.layout`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from models.config import ModelConfig
from models.m2m100 import BlockKind, block_specs
from parallel.pipeline.partition import resolve_partition
from parallel.pipeline.profile import BlockPhases
from parallel.pipeline.schedule import Action, build_schedule, placement_for
from parallel.pipeline.simulate import StageCosts, simulate
from trainer.planner.blocks import (
    KindCosts,
    Shape,
    block_expert_counts,
    block_param_counts,
    is_sparse_block,
    kind_key,
)
from trainer.planner.hardware import LinkModel
from trainer.planner.layout import SPLIT_BACKWARD, Layout
from trainer.planner.memory import MemorySettings, RankShape, rank_memory, rank_shape, startup_memory
from trainer.planner.moe import a2a_bytes, ep_inter_node
from trainer.planner.teacher import TeacherBlocks, teacher_step


@dataclass
class CostContext:
    """Everything `predict_step` needs besides the layout and the block costs."""

    mc: ModelConfig
    link: LinkModel
    gpus_per_node: int
    bf16: bool
    sequence_parallel: bool
    optimizer_s_per_param: float
    fetch_s_per_microbatch: float = 0.0
    # Executor and step overheads the block profile does not see (`trainer.planner.measure.measure_overheads`)
    action_overhead_s: float = 0.0  # per F and per B (or I) action of a stage on one micro-batch
    step_overhead_s: float = 0.0  # per optimizer step: barrier, clip, scheduler, bookkeeping
    host_baseline_bytes: float = 0.0  # the process's own bytes, on runs costed for this host's CPU
    host_cpu: bool = False  # costed for this host's CPU (`trainer.planner.memory.MemorySettings`)
    teacher: TeacherBlocks | None = None  # word-level distillation: the teacher's blocks for this cut

    @property
    def memory_settings(self) -> MemorySettings:
        return MemorySettings(self.bf16, self.host_baseline_bytes, self.host_cpu)


@dataclass
class Prediction:
    """A layout's predicted step: time split and the most loaded rank's memory."""

    step_time_s: float
    makespan_s: float
    bubble_fraction: float
    link_s: float
    grad_reduce_s: float
    optimizer_s: float
    data_s: float
    peak_memory_bytes: float  # the peak rank's steady peak, or its start-up if that is higher
    memory: dict[str, float]  # the peak rank's terms (`trainer.planner.memory.rank_memory`)
    params_per_pp_rank: list[int]
    peak_activation_bytes_per_pp_rank: list[float]
    stage_time_s: list[float] = field(default_factory=list)
    startup_memory_bytes: float = 0.0  # the largest start-up peak over pp ranks
    transients: dict[str, float] = field(default_factory=dict)  # the peak rank's step transients
    teacher_forward_s: float = 0.0  # distillation: the teacher's forward-only flushes (in step_time_s)


def block_costs(
    kinds: KindCosts,
    mc: ModelConfig,
    shape: Shape,
    tp: int,
    ctx: CostContext,
    ep: int = 1,
    recompute: bool = False,
) -> list[BlockPhases]:
    """Every block's costs on one (tp, ep) rank.

    Args:
        kinds: the block kinds' costs on one tp rank's shard (measured on it, or from the device
            table at 1/tp of the FLOPs): its compute and its activation bytes.
        tp: tensor-parallel size; adds Megatron's all-reduces of (b, len, H) activations.
        ep: expert-parallel size; sparse layers add their all-to-alls (`moe_a2a_s`).
        recompute: full remat (the sparse layers' forward all-to-alls run again in the backward).
    """
    out = []
    inter = tp > ctx.gpus_per_node
    e = 2 if ctx.bf16 else 4
    # Megatron all-reduces of (b, len, H) per block: forward, backward, len
    comm = {
        BlockKind.SRC_EMBED: (1, 0, shape.s),
        BlockKind.ENC_LAYER: (2, 2, shape.s),
        BlockKind.TGT_EMBED: (1, 0, shape.t),
        BlockKind.DEC_LAYER: (3, 3, shape.t),
        BlockKind.HEAD: (0, 1, shape.t),
    }
    for spec in block_specs(mc):
        ph = kinds[kind_key(mc, spec)]
        n_f, n_b, length = comm.get(spec.kind, (0, 0, 0))
        ar = ctx.link.all_reduce(shape.b * length * mc.d_model * e, tp, inter) if tp > 1 else 0.0
        a2a = moe_a2a_s(ctx, shape.b * length, ep, tp) if is_sparse_block(mc, spec) else 0.0
        a2a_b = a2a * (2 if recompute else 1)
        out.append(replace(ph, forward_s=ph.forward_s + n_f * ar + a2a, backward_s=ph.backward_s + n_b * ar + a2a_b,
                           backward_input_s=ph.backward_input_s + n_b * ar + a2a_b))  # fmt: skip
    return out


def moe_a2a_s(ctx: CostContext, n_tokens: int, ep: int, tp: int) -> float:
    """One pass (forward, or backward) of a sparse layer's two all-to-alls on `n_tokens`: the
    kept assignments' rows to other ranks (top-2, uniform routing) and back, both in the
    working dtype (bf16 under autocast: `models.moe.layer` casts the rows after the router)."""
    if ep <= 1:
        return 0.0
    e = 2 if ctx.bf16 else 4
    one_way = a2a_bytes(2 * n_tokens, ep, ctx.mc.d_model, e, e) / 4  # of forward + backward, both ways
    inter = ep_inter_node(ep, tp, ctx.gpus_per_node)
    return 2 * ctx.link.all_to_all(one_way, ep, inter)


def balance_from_costs(
    method: str, costs: Sequence[BlockPhases], params: Sequence[int], n_stages: int
) -> list[int]:
    """The balance the trainer's `partition_method` would pick from these per-block costs."""
    names = [str(i) for i in range(len(costs))]
    times = [c.forward_s + c.backward_s for c in costs]
    mems = [4.0 * p + c.activation_bytes for p, c in zip(params, costs)]
    return resolve_partition(method, names, n_stages, param_counts=params, time_costs=times, mem_costs=mems)


def _boundary_bytes(mc: ModelConfig, shape: Shape, block_index: int) -> float:
    """Bytes entering block `block_index` (fp32 residual stream): what a stage boundary sends."""
    kind = block_specs(mc)[block_index].kind
    tokens = shape.s if kind in (BlockKind.ENC_LAYER, BlockKind.ENC_NORM) else shape.s + shape.t
    return 0.0 if kind is BlockKind.SRC_EMBED else 4.0 * shape.b * tokens * mc.d_model


def stage_activation_bytes(costs: Sequence[BlockPhases], blocks: range) -> float:
    """Bytes a stage of `blocks` holds per micro-batch, counted as the executor's meter counts them.

    The stage's inputs once, each block's own saved bytes, and a tensor one block of the stage
    produces and a later one saves, or a micro-batch tensor several blocks save, once
    (`parallel.pipeline.profile.ActivationParts`). Summing the
    blocks' `activation_bytes` instead counts the encoder output once per decoder layer.
    """
    parts = [p for p in (costs[i].parts for i in blocks) if p is not None]
    if not parts or len(parts) < len(blocks):
        return float(sum(costs[i].activation_bytes for i in blocks))
    total = sum(n for _, n in parts[0].inputs) + sum(p.own for p in parts)
    total += sum(dict(kv for p in parts for kv in p.batch).values())  # each batch tensor once
    produced: dict[str, int] = {}  # made inside the stage, not counted yet
    for p in parts:
        for key in p.saved_inputs:
            total += produced.pop(key, 0)
        for key, n in p.outputs:
            if key not in p.passthrough:
                produced[key] = n
    return float(total)


def layout_stage_costs(
    layout: Layout, costs: Sequence[BlockPhases], shape: Shape, ctx: CostContext
) -> StageCosts:
    """The simulator's per-stage costs of `layout`: block costs summed by the balance, the p2p link.

    Non-zero-bubble schedules run the full B (`backward_input` = B, `backward_weight` = 0);
    "stage" remat recomputes the stage's forward in its backward and keeps only its input.
    """
    mc, n = ctx.mc, layout.pp * layout.v
    starts = [sum(layout.balance[:i]) for i in range(n)]
    ranges = [range(st, st + k) for st, k in zip(starts, layout.balance)]
    zb = layout.schedule in ("zero_bubble", "zbv")
    o = ctx.action_overhead_s
    fwd = [o + sum(costs[i].forward_s for i in r) for r in ranges]
    bin_ = [o + sum((costs[i].backward_input_s if zb else costs[i].backward_s) for i in r) for r in ranges]
    bw = [sum(costs[i].backward_weight_s for i in r) if zb else 0.0 for r in ranges]
    act = [stage_activation_bytes(costs, r) for r in ranges]
    if layout.remat == "stage":
        bin_ = [b + f for b, f in zip(bin_, fwd)]
        act = [max(_boundary_bytes(mc, shape, r.start), 1.0) for r in ranges]
    node, slab = max(1, ctx.gpus_per_node), layout.dp * layout.tp  # slab: global ranks per pp rank
    place = placement_for(layout.schedule, layout.pp, layout.v)
    hops = [(place.rank_of(i - 1), place.rank_of(i), st) for i, st in enumerate(starts) if i > 0]
    link = max(
        (ctx.link.p2p(_boundary_bytes(mc, shape, st), (a * slab) // node != (b * slab) // node)
         for a, b, st in hops if a != b),
        default=0.0,
    )  # fmt: skip
    return StageCosts(fwd, bin_, bw, link, act)


def _outside_pipeline(layout: Layout, ctx: CostContext) -> tuple[list[RankShape], float, float, float]:
    """(each pp rank's parameters, grad reduce s, optimizer s, data fetch s): a step's costs besides its flushes."""
    params_block, table = block_param_counts(ctx.mc, layout.tp, layout.ep)
    ranks = _rank_shapes(params_block, table, layout, ctx.mc)
    most = max(r.params for r in ranks)
    experts = max(r.experts for r in ranks)
    grad_reduce = _grad_reduce_s(most - experts, table, layout, ctx) + _expert_reduce_s(experts, layout, ctx)
    sharded = layout.sharding in ("zero1", "fsdp")
    optimizer = ctx.optimizer_s_per_param * most / (layout.dp if sharded else 1)
    data = ctx.fetch_s_per_microbatch * layout.m * layout.g
    return ranks, grad_reduce, optimizer + ctx.step_overhead_s, data


def lower_bound(layout: Layout, sc: StageCosts, ctx: CostContext) -> float:
    """A step time `predict_step` cannot undercut: the busiest rank's compute, no bubble, no p2p."""
    place = placement_for(layout.schedule, layout.pp, layout.v)
    busy = [0.0] * layout.pp
    for s in range(place.n):
        busy[place.rank_of(s)] += sc.forward[s] + sc.backward_input[s] + sc.backward_weight[s]
    _, reduce_s, optimizer_s, data_s = _outside_pipeline(layout, ctx)
    return layout.g * layout.m * max(busy) + reduce_s + optimizer_s + data_s


@functools.lru_cache(maxsize=256)
def _schedule(name: str, p: int, m: int, v: int) -> list[list[Action]]:
    return build_schedule(name, p, m, v)


def predict_step(layout: Layout, sc: StageCosts, ctx: CostContext) -> Prediction:
    """Predicted step time and per-rank memory of `layout` from its `layout_stage_costs` (module docstring).

    Raises:
        ValueError: the costs do not match the stages, or the schedule rejects (p, m, v).
    """
    p, v, m = layout.pp, layout.v, layout.m
    teacher = None
    if ctx.teacher is not None:
        teacher = teacher_step(
            layout, ctx.teacher, ctx.link, ctx.gpus_per_node, ctx.bf16, ctx.action_overhead_s
        )
    if teacher is not None:  # the KD loss makes the teacher's logits on the student's last stage
        sc = replace(sc, forward=[*sc.forward[:-1], sc.forward[-1] + teacher.kd_s])
    sim = simulate(_schedule(layout.schedule, p, m, v), p, m, v, sc)
    ranks, grad_reduce, optimizer, data = _outside_pipeline(layout, ctx)
    teacher_s = teacher.forward_s if teacher is not None else 0.0
    step = layout.g * sim.makespan + grad_reduce + optimizer + data + teacher_s
    settings = ctx.memory_settings
    deferred = p > 1 or layout.schedule in SPLIT_BACKWARD  # parallel.dp.fsdp's deferred mode
    mems = [rank_memory(r, a, layout.sharding, layout.dp, m * layout.g, deferred, settings, layout.ep)
            for r, a in zip(ranks, sim.peak_activation_bytes)]  # fmt: skip
    held = teacher.bytes_per_pp_rank if teacher is not None else [0.0] * p
    for r in range(p):
        if teacher is not None:
            mems[r][0]["teacher"] = held[r]
    worst = max(range(p), key=lambda r: sum(mems[r][0].values()))
    at_start = teacher.startup_bytes_per_pp_rank if teacher is not None else [0.0] * p
    startup = max(
        startup_memory(r, settings, layout.sharding, layout.dp, layout.ep) + t
        for r, t in zip(ranks, at_start)
    )
    stage_time = [f + b + w for f, b, w in zip(sc.forward, sc.backward_input, sc.backward_weight)]
    terms, transients = mems[worst]
    return Prediction(
        step, sim.makespan, sim.bubble_fraction, sc.link, grad_reduce, optimizer, data,
        max(sum(terms.values()), startup), terms, [r.params for r in ranks], list(sim.peak_activation_bytes),
        stage_time, startup, transients, teacher_s,
    )  # fmt: skip


def _rank_shapes(params_block: list[int], table: int, layout: Layout, mc: ModelConfig) -> list[RankShape]:
    """Parameters held by each pp rank (the tied table once per rank that uses it), and their largest pieces."""
    specs = block_specs(mc)
    experts = block_expert_counts(mc, layout.tp, layout.ep)
    out = []
    for r in range(layout.pp):
        stages = placement_for(layout.schedule, layout.pp, layout.v).stages_of(r)
        blocks = [i for s in stages for i in range(sum(layout.balance[:s]), sum(layout.balance[: s + 1]))]
        uses_table = any(specs[i].uses_shared_embedding for i in blocks)
        out.append(rank_shape(mc, blocks, params_block, table, uses_table, layout.tp, experts, layout.ep))
    return out


def _expert_reduce_s(experts: int, layout: Layout, ctx: CostContext) -> float:
    """The experts' fp32 grads reduced over edp = dp / ep (ZeRO-1: plus the broadcast; FSDP: a
    reduce-scatter and the gathers, as `_grad_reduce_s`); 0 without sparse layers on the rank."""
    edp = layout.dp // layout.ep
    if not experts or edp <= 1:
        return 0.0
    inter = edp * layout.ep * layout.tp > max(1, ctx.gpus_per_node)
    half = ctx.link.all_reduce(4.0 * experts, edp, inter) / 2
    if layout.sharding == "fsdp":
        return half + (layout.g if layout.pp > 1 else 2 * layout.m * layout.g) * half * (
            0.5 if ctx.bf16 else 1.0
        )
    return 2 * half + (half if layout.sharding == "zero1" else 0.0)


def _grad_reduce_s(params: int, table: int, layout: Layout, ctx: CostContext) -> float:
    """dp reduction of a rank's fp32 grads, plus the tied table's between first and last stage.

    none: a ring all-reduce; zero1: that and the updated parameters' broadcast (an all-gather's
    cost); fsdp: a reduce-scatter and the parameters' all-gathers in the working dtype, once per
    flush (pp > 1) or in every micro-batch's forward and backward (pp = 1), not overlapped.
    """
    node = max(1, ctx.gpus_per_node)
    dp_inter = layout.dp * layout.tp > node
    half = ctx.link.all_reduce(4.0 * params, layout.dp, dp_inter) / 2  # a reduce-scatter or all-gather
    if layout.sharding == "fsdp":
        gathers = layout.g if layout.pp > 1 else 2 * layout.m * layout.g
        t = half + gathers * half * (0.5 if ctx.bf16 else 1.0)
    else:
        t = 2 * half + (half if layout.sharding == "zero1" else 0.0)
    if layout.pp > 1:
        pp_inter = layout.pp * layout.dp * layout.tp > node
        t += ctx.link.all_reduce(4.0 * table, 2, pp_inter)
    return t


@dataclass
class Candidate:
    layout: Layout
    prediction: Prediction
    args: list[str]
