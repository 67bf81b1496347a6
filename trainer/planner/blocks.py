"""Per-block costs: one micro-batch through each block kind (embeddings, encoder layer, norm,
decoder layer, head), measured here on a one-layer copy of the model (`measure_kind_costs`) or
from FLOPs and the device table (`table_kind_costs`); parameter counts per block.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from models.config import ModelConfig
from models.m2m100 import IGNORE_INDEX, BlockKind, Seq2SeqBatch, block_specs
from parallel.pipeline.profile import BlockPhases, RunSetting, profile_kinds
from parallel.tp.layers import vocab_partition
from trainer.errors import ConfigError
from trainer.planner.hardware import DeviceSpec

LAYER_KINDS = (BlockKind.ENC_LAYER, BlockKind.DEC_LAYER)


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


def padded_vocab_config(mc: ModelConfig, multiple: int) -> ModelConfig:
    """`mc` with its vocabulary padded to a multiple of `multiple`, as tensor parallelism pads it
    (`parallel.tp.layers.vocab_partition`: V' = ceil(V / tp) tp rows, the padding never a real id).

    The planner costs a tp layout on this model: its table rows, head FLOPs and logits count V'.
    """
    padded, _, _ = vocab_partition(mc.vocab_size, multiple, 0)
    return mc if padded == mc.vocab_size else replace(mc, vocab_size=padded)


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
    return profile_kinds(mc, synthetic_batch(mc, shape), device or torch.device("cpu"), run, repeats, timed)


# A one-layer copy above this many parameters is not built: its activation bytes come from two narrow copies
WIDE_ONE_LAYER_PARAMS = 200_000_000
NARROW_FACTORS = (8, 16)


def narrow_config(mc: ModelConfig, k: int) -> ModelConfig:
    """The one-layer model with d_model, the FFNs and the vocabulary divided by k (heads kept)."""
    for name in ("d_model", "encoder_ffn_dim", "decoder_ffn_dim", "vocab_size"):
        if getattr(mc, name) % k:
            raise ConfigError(
                f"{name}={getattr(mc, name)} is not a multiple of {k}: cannot narrow the model by {k}"
            )
    return replace(one_layer_config(mc), d_model=mc.d_model // k, encoder_ffn_dim=mc.encoder_ffn_dim // k,
                   decoder_ffn_dim=mc.decoder_ffn_dim // k, vocab_size=mc.vocab_size // k)  # fmt: skip


def activation_kind_costs(
    mc: ModelConfig, shape: Shape, remat: str, tp: int = 1, sequence_parallel: bool = False
) -> KindCosts:
    """Activation bytes per block kind on a tp rank (times left 0), from the one-layer copy, or for
    a wide model (`WIDE_ONE_LAYER_PARAMS`) extrapolated from two narrow copies (`narrow_config`).

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
    if one_layer_config(mc).num_parameters() <= WIDE_ONE_LAYER_PARAMS:
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


def block_forward_flops(mc: ModelConfig, kind: BlockKind, shape: Shape) -> tuple[float, float]:
    """(forward FLOPs, of which in Attention modules) of one block on one micro-batch.

    The per-block split of `trainer.run.flops.step_flops` (2 FLOPs per multiply-add).
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
        share = {"full": 1.0, "selective": 0.5}.get(remat, 0.0) if kind in LAYER_KINDS else 0.0
        recompute = {"full": fwd, "selective": attn}.get(remat, 0.0) if kind in LAYER_KINDS else 0.0
        f = max(fwd / rate, host)
        w = fwd / rate if kind in LAYER_KINDS else 0.0
        i = max((2 * fwd + recompute) / rate - w, (2 + share) * host)
        act = int(measured.activation_bytes * act_scale)
        parts = measured.parts.scaled(act_scale) if measured.parts else None
        out[kind] = BlockPhases(f, i + w, i, w, act, parts)
    return out


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
