"""Per-block costs: one micro-batch through each block kind (embeddings, encoder layer, norm,
decoder layer, head), measured here on a one-layer copy of the model (`measure_kind_costs`) or
from FLOPs and the device table (`table_kind_costs`); parameter counts per block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from models.config import ModelConfig
from models.m2m100 import IGNORE_INDEX, BlockKind, M2M100Translation, Seq2SeqBatch, block_specs
from parallel.profile import BlockPhases, profile_block_phases
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

    "stage" remat is profiled as "none" (`layout_stage_costs` adds the stage's recompute and keeps
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
