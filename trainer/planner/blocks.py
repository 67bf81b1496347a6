"""Per-block costs: one micro-batch through each block kind (embeddings, encoder layer, norm,
decoder layer, head), measured here on a one-layer copy of the model (`measure_kind_costs`) or
from FLOPs and the device table (`table_kind_costs`); parameter counts per block.

NLLB-MoE: a sparse encoder / decoder layer is a kind of its own (`kind_key`: "enc_layer+moe",
"dec_layer+moe"), measured on a one-layer copy whose layers are sparse, or costed from its
FLOPs (`trainer.planner.moe`); its experts count E / ep per rank.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from models.config import ModelConfig
from models.m2m100 import IGNORE_INDEX, BlockKind, BlockSpec, Seq2SeqBatch, block_specs
from parallel.pipeline.profile import BlockPhases, RunSetting, profile_kinds
from parallel.tp.layers import vocab_partition
from trainer.errors import ConfigError
from trainer.planner.hardware import DeviceSpec
from trainer.planner.moe import expert_params, router_params, sparse_layer_flops

LAYER_KINDS = (BlockKind.ENC_LAYER, BlockKind.DEC_LAYER)
SPARSE = "+moe"  # suffix of a sparse layer's kind key


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


def one_layer_config(mc: ModelConfig, sparse: bool = False) -> ModelConfig:
    """The model with one encoder and one decoder layer: every block kind once (layers are alike);
    for an NLLB-MoE, both layers dense, or both sparse with `sparse`."""
    if not mc.is_moe:
        return replace(mc, encoder_layers=1, decoder_layers=1)
    step = 1 if sparse else 0
    return replace(mc, encoder_layers=1, decoder_layers=1, encoder_sparse_step=step, decoder_sparse_step=step)


def padded_vocab_config(mc: ModelConfig, multiple: int) -> ModelConfig:
    """`mc` with its vocabulary padded to a multiple of `multiple`, as tensor parallelism pads it
    (`parallel.tp.layers.vocab_partition`: V' = ceil(V / tp) tp rows, the padding never a real id).

    The planner costs a tp layout on this model: its table rows, head FLOPs and logits count V'.
    """
    padded, _, _ = vocab_partition(mc.vocab_size, multiple, 0)
    return mc if padded == mc.vocab_size else replace(mc, vocab_size=padded)


def is_sparse_block(mc: ModelConfig, spec: BlockSpec) -> bool:
    """Whether block `spec` is a sparse (MoE) encoder / decoder layer of `mc`."""
    return spec.kind in LAYER_KINDS and mc.is_sparse(spec.kind is BlockKind.DEC_LAYER, spec.index)


def kind_key(mc: ModelConfig, spec: BlockSpec) -> str:
    """The cost table's key of block `spec`: its kind, or its kind + "+moe" for a sparse layer."""
    return f"{spec.kind.value}{SPARSE}" if is_sparse_block(mc, spec) else spec.kind.value


# block kind (`BlockKind`, a str) or a sparse layer's key -> its costs
KindCosts = dict[str, BlockPhases]


def measure_kind_costs(
    mc: ModelConfig,
    shape: Shape,
    remat: str,
    bf16: bool,
    repeats: int = 5,
    timed: bool = True,
    device: torch.device | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> KindCosts:
    """Profile each block kind of a one-layer copy of the model on this machine, as one rank of
    the layout executes it (`parallel.pipeline.profile.profile_kinds`): its tp shard, and with
    `bf16` under autocast with bf16 working weights (whose bytes `trainer.planner.memory`
    counts apart from the activations).

    "stage" remat is profiled as "none" (`layout_stage_costs` adds the stage's recompute and keeps
    only its input). Dropout stays as configured (the training mode's cost).
    """
    dtype = torch.bfloat16 if bf16 else None
    run = RunSetting(tp, sequence_parallel and tp > 1, dtype, working_weights=bf16, remat=remat)
    out: KindCosts = {}
    # an NLLB-MoE: dense and sparse layers (asked of its sparse steps, not of its layers: a narrow
    # copy has one layer of each stack, which a step above 1 leaves dense)
    has_sparse = mc.is_moe and (mc.encoder_sparse_step > 0 or mc.decoder_sparse_step > 0)
    for sparse in [False, True] if has_sparse else [False]:
        one = one_layer_config(mc, sparse)
        kinds = profile_kinds(
            one, synthetic_batch(mc, shape), device or torch.device("cpu"), run, repeats, timed
        )
        for spec in block_specs(one):
            out.setdefault(kind_key(one, spec), kinds[spec.kind])
    return out


# A one-layer copy above WIDE_ONE_LAYER_PARAMS is not built where two narrow copies can stand in
# (`activation_kind_costs`): M2M100-1.2B's (171M parameters) took 1.4 CPU-s to build and run per
# (remat, tp), its narrow copies 0.03; its plan on 4 x 8 H100 went from 13.4 to 6.3 CPU-s, the
# same plan. Above DIRECT_MAX_PARAMS it is never built: a model the factors do not divide is refused.
WIDE_ONE_LAYER_PARAMS = 50_000_000
DIRECT_MAX_PARAMS = 200_000_000
NARROW_FACTORS = (8, 16)


def narrow_config(mc: ModelConfig, k: int) -> ModelConfig:
    """The one-layer model with d_model, the FFNs and the vocabulary divided by k (heads kept; the
    vocabulary rounded to the nearest integer)."""
    for name in ("d_model", "encoder_ffn_dim", "decoder_ffn_dim"):  # the vocabulary rounds (below)
        if getattr(mc, name) % k:
            raise ConfigError(
                f"{name}={getattr(mc, name)} is not a multiple of {k}: cannot narrow the model by {k}"
            )
    return replace(
        mc,
        encoder_layers=1,
        decoder_layers=1,
        d_model=mc.d_model // k,
        encoder_ffn_dim=mc.encoder_ffn_dim // k,
        decoder_ffn_dim=mc.decoder_ffn_dim // k,
        vocab_size=round(mc.vocab_size / k),
    )  # fmt: skip  (NLLB's 256206: off by < 1e-5)


def _narrows(mc: ModelConfig) -> bool:
    """Whether `narrow_config` makes both narrow copies of `mc` (its widths divide by the factors,
    its heads the narrowed d_model)."""
    try:
        for k in NARROW_FACTORS:
            narrow_config(mc, k)
    except (ConfigError, ValueError):
        return False
    return True


def activation_kind_costs(
    mc: ModelConfig, shape: Shape, remat: str, tp: int = 1, sequence_parallel: bool = False
) -> KindCosts:
    """Activation bytes per block kind on a tp rank (times left 0), from the one-layer copy, or for
    a wide model (`WIDE_ONE_LAYER_PARAMS`, where its widths allow) extrapolated from two narrow
    copies (`narrow_config`).

    Every saved tensor is either as wide as d_model, an FFN or the vocabulary (linear outputs,
    logits) or of no width (ids, masks, attention probabilities over the kept heads), so each
    byte count is A + B w in the width w = 1 / k: two narrow copies give A and B exactly, and
    w = 1 the full model's, without allocating it. A vocabulary that k does not divide (NLLB-200's
    256206) is padded to a multiple of lcm(k1, k2) first, as tp pads it: it counts at most
    lcm - 1 rows more than the layout's own padding (15 of 256206 with the default factors).
    """
    measure = functools.partial(
        measure_kind_costs, remat=remat, bf16=False, timed=False, tp=tp, sequence_parallel=sequence_parallel
    )
    widest = max(one_layer_config(mc, sparse).num_parameters() for sparse in (False, mc.is_moe))
    if widest <= WIDE_ONE_LAYER_PARAMS or (widest <= DIRECT_MAX_PARAMS and not _narrows(mc)):
        return measure(mc, shape)
    k1, k2 = NARROW_FACTORS
    mc = padded_vocab_config(mc, math.lcm(k1, k2))
    a, b = measure(narrow_config(mc, k1), shape), measure(narrow_config(mc, k2), shape)

    def full(n1: int, n2: int) -> int:  # A + B at w = 1 from (1/k1, n1), (1/k2, n2)
        slope = (n1 - n2) / (1 / k1 - 1 / k2)
        return round(n1 + slope * (1 - 1 / k1))

    out: KindCosts = {}
    for kind, pa in a.items():
        pb = b[kind]
        parts = None
        if pa.parts is not None and pb.parts is not None:
            pairs = lambda x, y: tuple((key, full(n, m)) for (key, n), (_, m) in zip(x, y))  # noqa: E731
            parts = replace(pa.parts, own=full(pa.parts.own, pb.parts.own),
                            inputs=pairs(pa.parts.inputs, pb.parts.inputs),
                            outputs=pairs(pa.parts.outputs, pb.parts.outputs),
                            batch=pairs(pa.parts.batch, pb.parts.batch))  # fmt: skip
        out[kind] = replace(pa, activation_bytes=full(pa.activation_bytes, pb.activation_bytes), parts=parts)
    return out


def block_forward_flops(mc: ModelConfig, key: str, shape: Shape) -> tuple[float, float]:
    """(forward FLOPs, of which in Attention modules) of one block (its `kind_key`) on one micro-batch.

    The per-block split of `trainer.run.flops.step_flops` (2 FLOPs per multiply-add); a sparse
    layer adds its router and the second expert of each token (`trainer.planner.moe`).
    """
    b, s, t, d = shape.b, shape.s, shape.t, mc.d_model
    kind, sparse = BlockKind(key.removesuffix(SPARSE)), key.endswith(SPARSE)
    if kind is BlockKind.ENC_LAYER:
        attn = 2 * b * (4 * s * d * d + 2 * s * s * d)
        extra = sparse_layer_flops(b * s, d, mc.encoder_ffn_dim, mc.num_experts) if sparse else 0.0
        return attn + 2 * b * s * 2 * d * mc.encoder_ffn_dim + extra, attn
    if kind is BlockKind.DEC_LAYER:
        attn = 2 * b * (4 * t * d * d + 2 * t * t * d) + 2 * b * (
            2 * t * d * d + 2 * s * d * d + 2 * t * s * d
        )
        extra = sparse_layer_flops(b * t, d, mc.decoder_ffn_dim, mc.num_experts) if sparse else 0.0
        return attn + 2 * b * t * 2 * d * mc.decoder_ffn_dim + extra, attn
    if kind is BlockKind.HEAD:
        return 2 * b * t * d * mc.vocab_size, 0.0
    return 0.0, 0.0


def table_kind_costs(
    mc: ModelConfig,
    shape: Shape,
    remat: str,
    device: DeviceSpec,
    activations: KindCosts,
    act_scale: float,
    tp: int = 1,
) -> KindCosts:
    """FLOP-based costs of one tp rank on `device`: max(FLOPs / tp / (peak x efficiency), host
    time) per phase (a tp rank runs every op of the block on 1/tp of its columns).

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
        fwd, attn = (f / tp for f in block_forward_flops(mc, kind, shape))
        layer = kind.removesuffix(SPARSE) in LAYER_KINDS
        share = {"full": 1.0, "selective": 0.5}.get(remat, 0.0) if layer else 0.0
        recompute = {"full": fwd, "selective": attn}.get(remat, 0.0) if layer else 0.0
        f = max(fwd / rate, host)
        w = fwd / rate if layer else 0.0
        i = max((2 * fwd + recompute) / rate - w, (2 + share) * host)
        act = int(measured.activation_bytes * act_scale)
        parts = measured.parts.scaled(act_scale) if measured.parts else None
        out[kind] = BlockPhases(f, i + w, i, w, act, parts)
    return out


def block_param_counts(mc: ModelConfig, tp: int = 1, ep: int = 1) -> tuple[list[int], int]:
    """(parameters per block with the tied table left out, the table's) on one (tp, ep) rank.

    Column-parallel weights and biases and row-parallel weights divide by tp; row-parallel
    biases and layer norms are replicated; the table's rows are padded to a multiple of tp.
    A sparse layer holds its router and E / ep experts (`block_expert_counts`) instead of an FFN.
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
    experts = block_expert_counts(mc, tp, ep)
    out = []
    for spec, x in zip(block_specs(mc), experts):
        n = per_kind[spec.kind]
        if x:  # the FFN's parameters give way to the router and the rank's experts
            n += x + router_params(mc) - ffn(_ffn_dim(mc, spec))
        out.append(n)
    return out, table


def _ffn_dim(mc: ModelConfig, spec: BlockSpec) -> int:
    return mc.decoder_ffn_dim if spec.kind is BlockKind.DEC_LAYER else mc.encoder_ffn_dim


def block_expert_counts(mc: ModelConfig, tp: int = 1, ep: int = 1) -> list[int]:
    """Expert parameters per block on one (tp, ep) rank (0 for every block but a sparse layer)."""
    return [
        expert_params(mc, _ffn_dim(mc, s), tp, ep) if is_sparse_block(mc, s) else 0 for s in block_specs(mc)
    ]
