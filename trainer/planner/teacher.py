"""A word-level distillation teacher in a plan (issue 35): what it adds to a layout, per step and per rank.

The trainer runs, before each of the student's g flushes, a forward-only flush of the frozen teacher
over the same m micro-batches (`parallel.distill.teacher`): the teacher cut by parameters into the
student's pp x v stages (v = 2 under zbv, whose V puts the last stage on rank 0; else 1), tp- and
ep-sharded, its weights held in the working dtype. Its head runs in the student's loss instead
(the teacher's logits made chunk by chunk on the student's last stage). So:

    time per step     g x the makespan of the teacher's forward-only pipeline (`simulate` on
                      `forward_only`, its stage forwards and boundary link), and on the student's
                      last stage, per micro-batch, the teacher's head (its HEAD kind's forward)
    bytes per pp rank e x the teacher's parameters there (e = 2 under bf16 / fp16, else 4), one of
                      its blocks' forward activations (the transient of a no-grad forward is at
                      most what the block saves for a backward), and on the student's last-stage
                      rank the flush's final hidden states, m x b t H_t x e, and the KD loss's
                      chunk, four fp32 (rows, V/tp) buffers (`parallel.distill.loss`)

`trainer.planner.measure.TeacherCosts` measures the teacher's block kinds as `CostSource` does the
student's (a one-layer copy here, or two narrow ones for a wide model, with a device table).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace

from models.config import ModelConfig
from models.loss import chunk_rows
from models.m2m100 import BlockKind, block_specs
from parallel.pipeline.profile import BlockPhases
from parallel.pipeline.schedule import forward_only, placement_for
from parallel.pipeline.simulate import StageCosts, simulate
from trainer.planner.blocks import Shape, block_param_counts
from trainer.planner.hardware import LinkModel
from trainer.planner.layout import Layout


@dataclass(frozen=True)
class TeacherBlocks:
    """The teacher's blocks on one (tp, ep) rank for one micro-batch shape (in a `CostContext`)."""

    mc: ModelConfig
    costs: tuple[BlockPhases, ...]  # per block: forward seconds (with tp / ep comm), activation bytes
    shape: Shape
    tp: int
    ep: int


@dataclass(frozen=True)
class TeacherStep:
    """What the teacher adds to one layout's step."""

    forward_s: float  # g flushes of its forward-only pipeline
    kd_s: float  # per micro-batch, on the student's last stage: its head's product
    bytes_per_pp_rank: list[float]
    startup_bytes_per_pp_rank: list[float]
    params_per_pp_rank: list[int]


def teacher_layout(layout: Layout, mc: ModelConfig) -> Layout:
    """The teacher's own cut on the student's mesh: its stages by parameters (as
    `trainer.run.distill.build_teacher`), gpipe with v = 1, or zbv's V with v = 2."""
    schedule, v = ("zbv", 2) if layout.schedule == "zbv" else ("gpipe", 1)
    balance = _param_partition(mc, layout.pp * v, layout.ep)
    return replace(layout, schedule=schedule, v=v, remat="none", partition="parameters", balance=balance)


def _param_partition(mc: ModelConfig, n_stages: int, ep: int) -> tuple[int, ...]:
    return _partition_of(json.dumps(mc.to_dict(), sort_keys=True), n_stages, ep)


@functools.lru_cache(maxsize=64)  # a meta model per (teacher, stages, ep): once per plan, not per layout
def _partition_of(config: str, n_stages: int, ep: int) -> tuple[int, ...]:
    from trainer.run.balance import param_partition

    return tuple(param_partition(ModelConfig.from_dict(json.loads(config)), n_stages, ep))


def teacher_step(
    layout: Layout,
    tb: TeacherBlocks,
    link: LinkModel,
    gpus_per_node: int,
    half: bool,
    overhead_s: float = 0.0,
) -> TeacherStep:
    """The teacher's time and bytes for `layout` (module docstring); `overhead_s` per forward action."""
    mc, shape = tb.mc, tb.shape
    lay = teacher_layout(layout, mc)
    specs = block_specs(mc)
    head = next(i for i, spec in enumerate(specs) if spec.kind is BlockKind.HEAD)
    kd_s = tb.costs[head].forward_s  # norm + the head's product (+ a loss: close to the KD loss's passes)
    n = lay.pp * lay.v
    starts = [sum(lay.balance[:s]) for s in range(n)]
    stages = [range(st, st + k) for st, k in zip(starts, lay.balance)]
    forward = [overhead_s + sum(tb.costs[i].forward_s for i in r if i != head) for r in stages]
    place = placement_for(lay.schedule, lay.pp, lay.v)
    slab = layout.dp * layout.tp  # global ranks per pp rank
    node = max(1, gpus_per_node)
    hops = [
        link.p2p(_boundary_bytes(mc, shape, st), (a * slab) // node != (b * slab) // node)
        for s, st in enumerate(starts)
        if s > 0 and (a := place.rank_of(s - 1)) != (b := place.rank_of(s))
    ]
    sc = StageCosts(forward, [0.0] * n, [0.0] * n, max(hops, default=0.0))
    sim = simulate(forward_only(place, layout.m), lay.pp, layout.m, lay.v, sc)
    params_block, table = block_param_counts(mc, tb.tp, tb.ep)
    e = 2.0 if half else 4.0
    rank_blocks = [[i for s in place.stages_of(r) for i in stages[s]] for r in range(lay.pp)]
    params = [
        sum(params_block[i] for i in blocks)
        + (table if any(specs[i].uses_shared_embedding for i in blocks) else 0)
        for blocks in rank_blocks
    ]
    transient = [max((tb.costs[i].activation_bytes for i in blocks), default=0.0) for blocks in rank_blocks]
    v_local = -(-mc.vocab_size // tb.tp)
    rows = min(shape.b * shape.t, max(1, chunk_rows(v_local) // 2))
    last = placement_for(layout.schedule, layout.pp, layout.v).rank_of(layout.pp * layout.v - 1)
    states = layout.m * shape.b * shape.t * mc.d_model * e + 16.0 * rows * v_local
    weights = [e * x for x in params]
    held = [w + t + (states if r == last else 0.0) for r, (w, t) in enumerate(zip(weights, transient))]
    return TeacherStep(layout.g * sim.makespan, kd_s, held, weights, params)


def _boundary_bytes(mc: ModelConfig, shape: Shape, block: int) -> float:
    """What enters block `block` from the previous stage: the fp32 residual stream (and encoder output)."""
    kind = block_specs(mc)[block].kind
    tokens = shape.s if kind in (BlockKind.ENC_LAYER, BlockKind.ENC_NORM) else shape.s + shape.t
    return 0.0 if kind is BlockKind.SRC_EMBED else 4.0 * shape.b * tokens * mc.d_model
