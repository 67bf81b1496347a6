"""The planner's cost model: what one layout costs per step, in seconds and bytes per rank.

    kind costs       one micro-batch through each block kind (embeddings, encoder layer, norm,
                     decoder layer, head): F, B, I, W seconds and the activation bytes the
                     executor's meter counts. Measured on this machine by
                     `parallel.profile.profile_block_phases` on a one-layer copy of the model
                     (`measure_kind_costs`), or for another device from FLOPs and a device
                     table (`table_kind_costs`; activation bytes still measured here, at one
                     sentence, and scaled by the micro-batch size)
    LinkModel        point-to-point and ring all-reduce times: latency + bytes / bandwidth,
                     intra- versus inter-node
    predict          a layout -> per-stage costs -> `parallel.simulate` on the schedule's real
                     action lists (makespan, bubble, peak activation bytes per pp rank)
                     + data fetch + dp / tied-embedding reduces + optimizer = step time;
                     parameters + grads + AdamW state (ZeRO-1: / dp) + bf16 working weights
                     + peak activations = memory per rank

Tensor parallelism is modelled, not measured: a block's compute divides by tp and pays
Megatron's all-reduces (2 per encoder layer, 3 per decoder layer, forward and backward,
of (B, T, H) activations). Legend: p = pp, m micro-batches, g accumulation flushes, v
stages per rank, b sentences per micro-batch, s / t padded source / target tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from models.config import ModelConfig
from models.m2m100 import IGNORE_INDEX, BlockKind, M2M100Translation, Seq2SeqBatch, block_specs
from parallel.partition import resolve_partition
from parallel.profile import BlockPhases, profile_block_phases
from parallel.schedule import Action, build_schedule, placement_for
from parallel.simulate import StageCosts, simulate
from trainer.flops import PEAK_FLOPS

GIB = 1024**3
LAYER_KINDS = (BlockKind.ENC_LAYER, BlockKind.DEC_LAYER)


@dataclass(frozen=True)
class LinkModel:
    """Transfer times from latency + bytes / bandwidth, inside a node and between nodes."""

    intra_latency_s: float
    intra_bytes_per_s: float
    inter_latency_s: float
    inter_bytes_per_s: float

    def p2p(self, nbytes: float, inter: bool) -> float:
        """Seconds for one message of `nbytes`."""
        if inter:
            return self.inter_latency_s + nbytes / self.inter_bytes_per_s
        return self.intra_latency_s + nbytes / self.intra_bytes_per_s

    def all_reduce(self, nbytes: float, n: int, inter: bool) -> float:
        """Seconds for a ring all-reduce of `nbytes` over n ranks: 2 (n-1) steps of nbytes / n."""
        if n <= 1:
            return 0.0
        latency, bw = (
            (self.inter_latency_s, self.inter_bytes_per_s)
            if inter
            else (self.intra_latency_s, self.intra_bytes_per_s)
        )
        return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bw


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator kind for FLOP-based costs (`table_kind_costs`).

    efficiency: share of peak FLOP/s the blocks' matmuls reach; block_overhead_s: host time of
    one block's forward + backward on one micro-batch, the floor when kernels are small.
    Both are fitted (least squares on relative error) to the four single-H100 eager runs of
    benchmarks/gpu_h100.md run 4: 1.2B 16 x 256 m=1 (0.189 s/step, predicted 0.179),
    418M 32 x 256 m=1 (0.101 / 0.103), 418M 4 x 8 (0.317 / 0.339), 418M 8 x 4 (0.691 / 0.664).
    The other devices reuse the H100's fit with their own peak, memory and links.
    """

    name: str
    peak_flops: float
    memory_gib: float
    hbm_bytes_per_s: float
    efficiency: float
    block_overhead_s: float
    link: LinkModel


# name -> (memory GiB, HBM bytes/s, NVLink all-reduce bus bytes/s, inter-node bytes/s per GPU)
_DEVICES: dict[str, tuple[float, float, float, float]] = {
    "H100": (79.6, 3.35e12, 360e9, 45e9),  # SXM, NVLink 4, one 400 Gb/s NIC per GPU
    "H200": (139.8, 4.8e12, 360e9, 45e9),
    "A100": (79.2, 2.0e12, 230e9, 22e9),  # SXM 80GB, NVLink 3, one 200 Gb/s NIC per GPU
}
H100_EFFICIENCY = 0.62
H100_BLOCK_OVERHEAD_S = 2.9e-3


def device_spec(name: str, bf16: bool) -> DeviceSpec:
    """The table's entry for `name` (H100, H200, A100), peak by precision.

    Raises:
        ValueError: an unknown device name, listing the known ones.
    """
    if name not in _DEVICES:
        raise ValueError(f"unknown device {name!r}; the device table knows {sorted(_DEVICES)}")
    mem, hbm, nvlink, net = _DEVICES[name]
    peak = PEAK_FLOPS[name][0 if bf16 else 1]
    link = LinkModel(8e-6, nvlink, 15e-6, net)
    return DeviceSpec(name, peak, mem, hbm, H100_EFFICIENCY, H100_BLOCK_OVERHEAD_S, link)


@dataclass(frozen=True)
class Shape:
    """One micro-batch: b sentences padded to s source and t target tokens."""

    b: int
    s: int
    t: int


def synthetic_batch(mc: ModelConfig, shape: Shape, seed: int = 0) -> Seq2SeqBatch:
    """A micro-batch of `shape` with random token ids (every row full length)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, mc.vocab_size, (shape.b, shape.s), generator=g)
    src[:, -1] = mc.eos_token_id
    labels = torch.randint(4, mc.vocab_size, (shape.b, shape.t), generator=g)
    dec = torch.full_like(labels, mc.pad_token_id)
    dec[:, 0] = mc.decoder_start_token_id
    dec[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] == IGNORE_INDEX, mc.pad_token_id)
    return Seq2SeqBatch(src, torch.ones_like(src), dec, labels)


def one_layer_config(mc: ModelConfig) -> ModelConfig:
    """The model with one encoder and one decoder layer: every block kind once (layers are alike)."""
    return replace(mc, encoder_layers=1, decoder_layers=1)


KindCosts = dict[BlockKind, BlockPhases]


def measure_kind_costs(
    mc: ModelConfig,
    shape: Shape,
    remat: str,
    bf16: bool,
    repeats: int = 5,
    timed: bool = True,
    device: torch.device | None = None,
) -> KindCosts:
    """Profile each block kind of a one-layer copy of the model on this machine.

    "stage" remat is profiled as "none" (`stage_costs` adds the stage's recompute and keeps
    only its input). Dropout stays as configured (the training mode's cost).
    """
    from parallel.remat import apply_remat

    torch.manual_seed(0)
    model = M2M100Translation(one_layer_config(mc)).to(device or torch.device("cpu"))
    model.train()
    apply_remat(model, "none" if remat == "stage" else remat)
    batch = synthetic_batch(mc, shape).to(device or torch.device("cpu"))
    dtype = torch.bfloat16 if bf16 else None
    phases = profile_block_phases(model, batch, repeats, dtype, timed=timed)
    return {spec.kind: ph for spec, ph in zip(model.blocks, phases)}


def block_forward_flops(mc: ModelConfig, kind: BlockKind, shape: Shape) -> tuple[float, float]:
    """(forward FLOPs, of which in Attention modules) of one block on one micro-batch.

    The per-block split of `trainer.flops.step_flops` (2 FLOPs per multiply-add).
    """
    b, s, t, d = shape.b, shape.s, shape.t, mc.d_model
    if kind is BlockKind.ENC_LAYER:
        attn = 2 * b * (4 * s * d * d + 2 * s * s * d)
        return attn + 2 * b * s * 2 * d * mc.encoder_ffn_dim, attn
    if kind is BlockKind.DEC_LAYER:
        attn = 2 * b * (4 * t * d * d + 2 * t * t * d) + 2 * b * (
            2 * t * d * d + 2 * s * d * d + 2 * t * s * d
        )
        return attn + 2 * b * t * 2 * d * mc.decoder_ffn_dim, attn
    if kind is BlockKind.HEAD:
        return 2 * b * t * d * mc.vocab_size, 0.0
    return 0.0, 0.0


def table_kind_costs(
    mc: ModelConfig, shape: Shape, remat: str, device: DeviceSpec, activations: KindCosts, act_scale: float
) -> KindCosts:
    """FLOP-based costs on `device`: max(FLOPs / (peak x efficiency), host time) per phase.

    Backward is twice the forward (I and W one each for the layers' linears; the head and
    embeddings compute their weight grads inside I). Host time: a third of the block overhead
    for F, two thirds for B. Remat adds the recomputed forward, FLOPs and host time, to B and
    I: full = the whole layer, selective = its attention modules (counted as half the ops).
    Activation bytes: `activations` (measured here, at one sentence) times `act_scale`.
    """
    out: KindCosts = {}
    rate = device.peak_flops * device.efficiency
    host = device.block_overhead_s / 3
    for kind, measured in activations.items():
        fwd, attn = block_forward_flops(mc, kind, shape)
        share = {"full": 1.0, "selective": 0.5}.get(remat, 0.0) if kind in LAYER_KINDS else 0.0
        recompute = {"full": fwd, "selective": attn}.get(remat, 0.0) if kind in LAYER_KINDS else 0.0
        f = max(fwd / rate, host)
        w = fwd / rate if kind in LAYER_KINDS else 0.0
        i = max((2 * fwd + recompute) / rate - w, (2 + share) * host)
        act = int(measured.activation_bytes * act_scale)
        parts = measured.parts.scaled(act_scale) if measured.parts else None
        out[kind] = BlockPhases(f, i + w, i, w, act, parts)
    return out


# ----------------------------------------------------------------------------- parameters


def block_param_counts(mc: ModelConfig, tp: int = 1) -> tuple[list[int], int]:
    """(parameters per block with the tied table left out, the table's) on one tp rank.

    Column-parallel weights and biases and row-parallel weights divide by tp; row-parallel
    biases and layer norms are replicated; the table's rows are padded to a multiple of tp.
    """
    d = mc.d_model
    norm = 2 * d

    def attention() -> int:
        return 4 * d * d // tp + 3 * d // tp + d

    def ffn(f: int) -> int:
        return 2 * d * f // tp + f // tp + d

    per_kind = {
        BlockKind.SRC_EMBED: 0,
        BlockKind.ENC_LAYER: attention() + ffn(mc.encoder_ffn_dim) + 2 * norm,
        BlockKind.ENC_NORM: norm,
        BlockKind.TGT_EMBED: 0,
        BlockKind.DEC_LAYER: 2 * attention() + ffn(mc.decoder_ffn_dim) + 3 * norm,
        BlockKind.HEAD: norm,
    }
    table = -(-mc.vocab_size // tp) * d
    return [per_kind[spec.kind] for spec in block_specs(mc)], table


# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """One way to run the job: mesh, batch cut, schedule, remat and the partition.

    `microbatch` is sentences per micro-batch, or its token cap when `token_mode`.
    """

    pp: int
    tp: int
    dp: int
    m: int
    g: int
    microbatch: int
    schedule: str
    v: int
    remat: str
    partition: str
    balance: tuple[int, ...] = ()
    token_mode: bool = False


@dataclass
class CostContext:
    """Everything `predict` needs besides the layout and the block costs."""

    mc: ModelConfig
    link: LinkModel
    gpus_per_node: int
    bf16: bool
    zero1: bool
    sequence_parallel: bool
    optimizer_s_per_param: float
    fetch_s_per_microbatch: float = 0.0
    # Executor and step overheads the block profile does not see (`plan_measure.measure_overheads`)
    action_overhead_s: float = 0.0  # per F and per B (or I) action of a stage on one micro-batch
    step_overhead_s: float = 0.0  # per optimizer step: barrier, clip, scheduler, bookkeeping


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
    peak_memory_bytes: float
    memory: dict[str, float]  # the peak rank's parameters, grads, optimizer, working, activations
    params_per_pp_rank: list[int]
    peak_activation_bytes_per_pp_rank: list[float]
    stage_time_s: list[float] = field(default_factory=list)


def tp_shape(shape: Shape, tp: int) -> tuple[Shape, float]:
    """The micro-batch whose single-device cost stands in for one tp rank's share, and a time factor.

    A tp rank runs every op of the layer on 1/tp of its columns: the FLOPs of the layer on
    b/tp rows, with the same number of ops (per-op host overhead does not shrink). So its
    compute is costed as the block's on b/tp sentences, times (b/tp) / round(b/tp).
    """
    rows = max(1, round(shape.b / tp))
    return Shape(rows, shape.s, shape.t), shape.b / tp / rows


def block_costs(
    kinds: KindCosts,
    kinds_tp: KindCosts,
    factor: float,
    mc: ModelConfig,
    shape: Shape,
    tp: int,
    ctx: CostContext,
) -> list[BlockPhases]:
    """Every block's costs on one tp rank.

    Args:
        kinds: the block kinds' costs on the whole micro-batch (for activation bytes).
        kinds_tp, factor: costs on `tp_shape(shape, tp)` and its time factor (the rank's compute).
        tp: tensor-parallel size; adds Megatron's all-reduces, shards activations
            (all with sequence parallelism; all but ~30% otherwise, Korthikanti et al. 2022).
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
    replicated = 0.0 if ctx.sequence_parallel else 0.3  # norms, residuals, dropout masks
    for spec in block_specs(mc):
        full, ph = kinds[spec.kind], kinds_tp[spec.kind]
        n_f, n_b, length = comm.get(spec.kind, (0, 0, 0))
        ar = ctx.link.all_reduce(shape.b * length * mc.d_model * e, tp, inter) if tp > 1 else 0.0
        shard = replicated + (1 - replicated) / tp
        out.append(
            BlockPhases(
                ph.forward_s * factor + n_f * ar,
                ph.backward_s * factor + n_b * ar,
                ph.backward_input_s * factor + n_b * ar,
                ph.backward_weight_s * factor,
                int(full.activation_bytes * shard),
                full.parts.scaled(shard) if full.parts else None,
            )
        )
    return out


def choose_balance(
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
    produces and a later one saves, once (`parallel.profile.ActivationParts`). Summing the
    blocks' `activation_bytes` instead counts the encoder output once per decoder layer.
    """
    parts = [p for p in (costs[i].parts for i in blocks) if p is not None]
    if not parts or len(parts) < len(blocks):
        return float(sum(costs[i].activation_bytes for i in blocks))
    total = sum(n for _, n in parts[0].inputs) + sum(p.own for p in parts)
    produced: dict[str, int] = {}  # made inside the stage, not counted yet
    for p in parts:
        for key in p.saved_inputs:
            total += produced.pop(key, 0)
        for key, n in p.outputs:
            if key not in p.passthrough:
                produced[key] = n
    return float(total)


def stage_costs(layout: Layout, costs: Sequence[BlockPhases], shape: Shape, ctx: CostContext) -> StageCosts:
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


def _outside_pipeline(layout: Layout, ctx: CostContext) -> tuple[list[int], float, float, float]:
    """(parameters per pp rank, grad reduce s, optimizer s, data fetch s): a step's costs besides its flushes."""
    params_block, table = block_param_counts(ctx.mc, layout.tp)
    rank_params = _rank_params(params_block, table, layout, ctx.mc)
    grad_reduce = _grad_reduce_s(max(rank_params), table, layout, ctx)
    optimizer = ctx.optimizer_s_per_param * max(rank_params) / (layout.dp if ctx.zero1 else 1)
    data = ctx.fetch_s_per_microbatch * layout.m * layout.g
    return rank_params, grad_reduce, optimizer + ctx.step_overhead_s, data


def lower_bound(layout: Layout, sc: StageCosts, ctx: CostContext) -> float:
    """A step time `predict` cannot undercut: the busiest rank's compute, no bubble, no p2p."""
    place = placement_for(layout.schedule, layout.pp, layout.v)
    busy = [0.0] * layout.pp
    for s in range(place.n):
        busy[place.rank_of(s)] += sc.forward[s] + sc.backward_input[s] + sc.backward_weight[s]
    _, reduce_s, optimizer_s, data_s = _outside_pipeline(layout, ctx)
    return layout.g * layout.m * max(busy) + reduce_s + optimizer_s + data_s


@functools.lru_cache(maxsize=256)
def _schedule(name: str, p: int, m: int, v: int) -> list[list[Action]]:
    return build_schedule(name, p, m, v)


def predict(layout: Layout, sc: StageCosts, ctx: CostContext) -> Prediction:
    """Predicted step time and per-rank memory of `layout` from its `stage_costs` (module docstring).

    Raises:
        ValueError: the costs do not match the stages, or the schedule rejects (p, m, v).
    """
    p, v, m = layout.pp, layout.v, layout.m
    sim = simulate(_schedule(layout.schedule, p, m, v), p, m, v, sc)
    rank_params, grad_reduce, optimizer, data = _outside_pipeline(layout, ctx)
    step = layout.g * sim.makespan + grad_reduce + optimizer + data
    mems = [_rank_memory(n_p, a, layout, ctx) for n_p, a in zip(rank_params, sim.peak_activation_bytes)]
    worst = max(range(p), key=lambda r: sum(mems[r].values()))
    stage_time = [f + b + w for f, b, w in zip(sc.forward, sc.backward_input, sc.backward_weight)]
    return Prediction(
        step, sim.makespan, sim.bubble_fraction, sc.link, grad_reduce, optimizer, data,
        sum(mems[worst].values()), mems[worst], rank_params, list(sim.peak_activation_bytes), stage_time,
    )  # fmt: skip


def _rank_params(params_block: list[int], table: int, layout: Layout, mc: ModelConfig) -> list[int]:
    """Parameters held by each pp rank (the tied table once per rank that uses it)."""
    specs = block_specs(mc)
    out = []
    for r in range(layout.pp):
        stages = placement_for(layout.schedule, layout.pp, layout.v).stages_of(r)
        blocks = [i for s in stages for i in range(sum(layout.balance[:s]), sum(layout.balance[: s + 1]))]
        uses_table = any(specs[i].uses_shared_embedding for i in blocks)
        out.append(sum(params_block[i] for i in blocks) + (table if uses_table else 0))
    return out


def _grad_reduce_s(params: int, table: int, layout: Layout, ctx: CostContext) -> float:
    """dp all-reduce of a rank's fp32 grads, plus the tied table's between first and last stage."""
    node = max(1, ctx.gpus_per_node)
    dp_inter = layout.dp * layout.tp > node
    t = ctx.link.all_reduce(4.0 * params, layout.dp, dp_inter)
    if layout.pp > 1:
        pp_inter = layout.pp * layout.dp * layout.tp > node
        t += ctx.link.all_reduce(4.0 * table, 2, pp_inter)
    return t


def _rank_memory(params: int, activations: float, layout: Layout, ctx: CostContext) -> dict[str, float]:
    """Bytes of one rank: fp32 params and grads, AdamW's two moments, bf16 working copies."""
    working = 2.0 * params if ctx.bf16 and layout.m * layout.g > 1 else 0.0
    return {
        "parameters": 4.0 * params,
        "gradients": 4.0 * params,
        "optimizer": 8.0 * params / (layout.dp if ctx.zero1 else 1),
        "working_weights": working,
        "activations": activations,
    }


@dataclass
class Candidate:
    layout: Layout
    prediction: Prediction
    args: list[str]
