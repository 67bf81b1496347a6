"""The M2M100/NLLB translation Transformer for one device, as an ordered list of blocks.

The model is written once, with no knowledge of parallelism. It is a sequence of
*blocks* that a pipeline can cut anywhere:

    src_embed, encoder.layers.0 .. encoder.layers.{E-1}, encoder.layer_norm,
    tgt_embed, decoder.layers.0 .. decoder.layers.{D-1}, head

Each block maps a *state* (a dict of tensors crossing block boundaries) to the
next state, reading the micro-batch's integer inputs (ids, masks) directly:

    src_embed   {}                         -> {hidden}              hidden: (B, S, H)
    enc layer   {hidden}                   -> {hidden}
    enc norm    {hidden}                   -> {encoder_out}         encoder_out: (B, S, H)
    tgt_embed   {encoder_out}              -> {encoder_out, hidden} hidden: (B, T, H)
    dec layer   {encoder_out, hidden}      -> {encoder_out, hidden}
    head        {encoder_out?, hidden}     -> {logits}              logits: (B, T, V)

Parameter names equal `transformers.M2M100ForConditionalGeneration`'s without the
leading `model.` (`shared.weight`, `encoder.layers.3.fc1.weight`, ...), and layers
live in `nn.ModuleDict`s keyed by their global index, so a pipeline stage that keeps
only some blocks still names them the same (stable fully-qualified names).

Tensor parallelism is applied from outside by swapping the `nn.Linear` /
`nn.Embedding` / `LMHead` modules; attention therefore derives its local head count
from the width of its projections' output rather than from the config. Attention
projections are fused (q, k, v in one matmul; see `models.attention.Attention`); `models.hf`
maps them to and from HF's separate tensors. NLLB-MoE layers replace the FFN by `models.moe`'s
`SparseFFN` (`ffn`) in the layers transformers makes sparse; the block list is the same. Each dropout site
draws inside a hook (`models.attention.DropoutRng`) a runner may point at a stream of its
own (tp draws per rank: `parallel.tp.rng`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import Attention as Attention  # re-exported: importers name them from here
from models.attention import DropoutRng, dropout_at
from models.attention import KVCache as KVCache
from models.batch import Seq2SeqBatch as Seq2SeqBatch
from models.config import ModelConfig
from models.init import LocalSlice, keyed_init
from models.loss import IGNORE_INDEX as IGNORE_INDEX  # re-exported too
from models.loss import cross_entropy_sum
from models.moe import MoECall, MoERun, SparseFFN, build_sparse_ffn, is_expert_param, keyed_expert_init

State = dict[str, Tensor]


class BlockKind(str, Enum):
    SRC_EMBED = "src_embed"
    ENC_LAYER = "enc_layer"
    ENC_NORM = "enc_norm"
    TGT_EMBED = "tgt_embed"
    DEC_LAYER = "dec_layer"
    HEAD = "head"


@dataclass(frozen=True)
class BlockSpec:
    """One block of the model; `index` is the layer index for encoder/decoder layers."""

    kind: BlockKind
    index: int = 0

    @property
    def name(self) -> str:
        if self.kind is BlockKind.ENC_LAYER:
            return f"encoder.layers.{self.index}"
        if self.kind is BlockKind.DEC_LAYER:
            return f"decoder.layers.{self.index}"
        if self.kind is BlockKind.ENC_NORM:
            return "encoder.layer_norm"
        if self.kind is BlockKind.HEAD:
            return "decoder.layer_norm+lm_head"
        return self.kind.value

    @property
    def uses_shared_embedding(self) -> bool:
        return self.kind in (BlockKind.SRC_EMBED, BlockKind.TGT_EMBED, BlockKind.HEAD)


def block_specs(config: ModelConfig) -> list[BlockSpec]:
    """The model's blocks in execution order."""
    return (
        [BlockSpec(BlockKind.SRC_EMBED)]
        + [BlockSpec(BlockKind.ENC_LAYER, i) for i in range(config.encoder_layers)]
        + [BlockSpec(BlockKind.ENC_NORM), BlockSpec(BlockKind.TGT_EMBED)]
        + [BlockSpec(BlockKind.DEC_LAYER, i) for i in range(config.decoder_layers)]
        + [BlockSpec(BlockKind.HEAD)]
    )


# ----------------------------------------------------------------------------- layers


def sinusoidal_table(num_positions: int, dim: int, padding_idx: int) -> Tensor:
    """fairseq/tensor2tensor sinusoids, as `M2M100SinusoidalPositionalEmbedding.get_embedding`."""
    half = dim // 2
    scale = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -scale)
    angles = torch.arange(num_positions, dtype=torch.float32).unsqueeze(1) * freqs.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    table[padding_idx, :] = 0
    return table


class SinusoidalPositions(nn.Module):
    """Positions count non-pad tokens from `padding_idx + 1`; pads get the zero row."""

    def __init__(self, max_positions: int, dim: int, padding_idx: int) -> None:
        super().__init__()
        self.dim, self.padding_idx = dim, padding_idx
        self.table: Tensor
        self.register_buffer("table", sinusoidal_table(max_positions + 2, dim, padding_idx), persistent=False)

    def reset_table(self) -> None:
        """Recompute the table on its device (after `to_empty` of a meta-built model)."""
        n = self.table.shape[0]
        self.table = sinusoidal_table(n, self.dim, self.padding_idx).to(self.table.device)

    def position_ids(self, ids: Tensor, offset: int = 0) -> Tensor:
        mask = ids.ne(self.padding_idx).int()
        return ((torch.cumsum(mask, dim=1) + offset) * mask).long() + self.padding_idx

    def forward(self, ids: Tensor, offset: int = 0) -> Tensor:  # (B, T) -> (B, T, H)
        pos = self.position_ids(ids, offset)
        # The largest position is at most T + offset + padding_idx: sized from the shape, not read back.
        needed = ids.shape[1] + offset + self.padding_idx + 1
        if needed > self.table.shape[0]:
            self.table = sinusoidal_table(needed + 2, self.dim, self.padding_idx).to(self.table)
        return self.table.index_select(0, pos.reshape(-1)).view(*ids.shape, self.dim)


ACT_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
}


class _Layer(nn.Module):
    """What encoder and decoder layers share: the FFN, dense (`fc1`, `fc2`, M2M100's names) or
    sparse (`ffn`, a `models.moe.SparseFFN`: an NLLB-MoE layer)."""

    def _init_ffn(self, c: ModelConfig, ffn_dim: int, sparse: SparseFFN | None) -> None:
        self.is_sparse = sparse is not None
        if sparse is not None:
            self.ffn = sparse
        else:
            self.fc1 = nn.Linear(c.d_model, ffn_dim)
            self.fc2 = nn.Linear(ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)
        self.act = ACT_FNS[c.activation_function]
        self.dropout, self.activation_dropout = c.dropout, c.activation_dropout
        self.dropout_rng: DropoutRng = nullcontext  # residual-branch masks
        self.activation_dropout_rng: DropoutRng = nullcontext  # FFN-hidden masks

    def feed_forward(self, x: Tensor, moe: MoECall | None = None) -> Tensor:
        """The FFN branch, dropout included: Drop(fc2(Drop_act(act(fc1 x)))), or the sparse FFN
        (its experts drop their own outputs; fairseq adds no residual dropout after an MoE layer)."""
        if self.is_sparse:
            return self.ffn(x, moe)  # type: ignore[no-any-return]
        h = self.act(self.fc1(x))
        h = self.fc2(dropout_at(self.activation_dropout_rng, h, self.activation_dropout, self.training))
        return dropout_at(self.dropout_rng, h, self.dropout, self.training)

    def residual(self, x: Tensor, h: Tensor) -> Tensor:
        """x + Drop(h)."""
        return x + dropout_at(self.dropout_rng, h, self.dropout, self.training)


class EncoderLayer(_Layer):
    """Pre-LN: x + Drop(SelfAttn(LN(x))); x + FFN(LN(x)) (see `feed_forward`)."""

    def __init__(self, c: ModelConfig, sparse: SparseFFN | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(c.d_model, c.encoder_attention_heads, c.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self._init_ffn(c, c.encoder_ffn_dim, sparse)

    def forward(self, x: Tensor, src_mask: Tensor | None, moe: MoECall | None = None) -> Tensor:
        """`moe`: what a sparse layer routes with (padding, micro-batch); None: evaluation defaults."""
        x = self.residual(x, self.self_attn(self.self_attn_layer_norm(x), key_mask=src_mask))
        return x + self.feed_forward(self.final_layer_norm(x), moe)


class DecoderLayer(_Layer):
    """Pre-LN: causal self-attention, cross-attention on the encoder output, FFN."""

    def __init__(self, c: ModelConfig, sparse: SparseFFN | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(c.d_model, c.decoder_attention_heads, c.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.encoder_attn = Attention(c.d_model, c.decoder_attention_heads, c.attention_dropout, cross=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(c.d_model)
        self._init_ffn(c, c.decoder_ffn_dim, sparse)

    def forward(
        self,
        x: Tensor,
        encoder_out: Tensor,
        src_mask: Tensor | None,
        self_cache: KVCache | None = None,
        cross_kv: tuple[Tensor, Tensor] | None = None,
        moe: MoECall | None = None,
    ) -> Tensor:
        """`self_cache` and `cross_kv` are for incremental decoding (`models.generate`); `moe` as
        in `EncoderLayer.forward`."""
        x = self.residual(x, self.self_attn(self.self_attn_layer_norm(x), causal=True, cache=self_cache))
        h = self.encoder_attn(
            self.encoder_attn_layer_norm(x), kv=encoder_out, key_mask=src_mask, cached_kv=cross_kv
        )
        x = self.residual(x, h)
        return x + self.feed_forward(self.final_layer_norm(x), moe)


class Stack(nn.Module):
    """Layers keyed by global index (stable names under a pipeline split) and a final norm."""

    def __init__(self, layers: Iterable[nn.Module], d_model: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
        self.layer_norm: nn.Module | None = nn.LayerNorm(d_model)


class LMHead(nn.Module):
    """logits = h E^T with the shared embedding E (no parameters of its own).

    A separate module so tensor parallelism can swap in a vocab-parallel head.
    """

    def forward(self, h: Tensor, weight: Tensor) -> Tensor:  # (B, T, H) x (V, H) -> (B, T, V)
        return F.linear(h, weight)


# ----------------------------------------------------------------------------- model


class M2M100Translation(nn.Module):
    """M2M100/NLLB encoder-decoder with a shared source/target/output embedding."""

    def __init__(self, config: ModelConfig, seed: int | None = None) -> None:
        """Build with the keyed initial weights of `seed` (`models.init`); None: the seed of the
        last `torch.manual_seed` (`torch.initial_seed()`), so `manual_seed(s); M2M100Translation(c)`
        equals `M2M100Translation(c, seed=s)`. Under `torch.device("meta")` nothing is drawn:
        materialise a pruned / sharded copy later with `init_value` (`parallel.materialize`)."""
        super().__init__()
        config.validate()
        self.config = config
        c = config
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
        self.shared: nn.Module | None = nn.Embedding(c.vocab_size, c.d_model, padding_idx=c.pad_token_id)
        self.positions = SinusoidalPositions(c.max_position_embeddings, c.d_model, c.pad_token_id)
        # NLLB-MoE: the sparse layers' router options and per-step keys, shared by all of them.
        self.moe = MoERun(aux_loss_coef=c.router_aux_loss_coef, n_sparse_layers=len(c.sparse_layers()))
        self.encoder = Stack(
            (EncoderLayer(c, self._sparse_ffn(False, i)) for i in range(c.encoder_layers)), c.d_model
        )
        self.decoder = Stack(
            (DecoderLayer(c, self._sparse_ffn(True, i)) for i in range(c.decoder_layers)), c.d_model
        )
        self.lm_head: nn.Module | None = LMHead()
        self.blocks: list[BlockSpec] = block_specs(c)
        self.skip_layers: frozenset[str] = frozenset()  # LayerDrop: block names skipped this step
        # Pass the source key mask to the layers even when no row is padded (a compiled model:
        # its layers then meet one graph structure, `parallel.compile`); False: None there, so
        # SDPA may pick its mask-free kernel.
        self.always_mask = False
        self.reset_parameters(seed)

    # --- construction helpers

    def _sparse_ffn(self, decoder: bool, index: int) -> SparseFFN | None:
        c = self.config
        if not c.is_sparse(decoder, index):
            return None
        name = f"{'decoder' if decoder else 'encoder'}.layers.{index}"
        ffn_dim = c.decoder_ffn_dim if decoder else c.encoder_ffn_dim
        return build_sparse_ffn(c, ffn_dim, name, self.moe, ACT_FNS[c.activation_function])

    def sparse_ffns(self) -> dict[str, SparseFFN]:
        """This model's sparse FFNs by layer name (`encoder.layers.3`), encoder first."""
        out: dict[str, SparseFFN] = {}
        for side, stack in (("encoder", self.encoder), ("decoder", self.decoder)):
            for key, layer in stack.layers.items():
                if isinstance(layer, _Layer) and layer.is_sparse:
                    out[f"{side}.layers.{key}"] = layer.ffn
        return out

    def init_value(self, name: str, part: LocalSlice, seed: int) -> Tensor:
        """Initial value (float32, CPU) of `part` of logical parameter `name` for `seed`:
        HF M2M100's distribution, drawn per parameter (`models.init.keyed_init`)."""
        if is_expert_param(name):  # each expert's slice keyed by its transformers name
            return keyed_expert_init(name, part, seed, self.config.init_std)
        pad = self.config.pad_token_id if name == "shared.weight" else None
        return keyed_init(name, part, seed, self.config.init_std, pad)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Every parameter from its own keyed generator (`init_value`); a no-op on the meta device.

        Args:
            seed: the init seed; None: `torch.initial_seed()`.
        """
        if any(p.is_meta for p in self.parameters()):
            return
        seed = torch.initial_seed() if seed is None else seed
        for name, param in self.named_parameters():
            param.copy_(self.init_value(name, LocalSlice.whole(param.shape), seed))

    def reset_buffers(self) -> None:
        """Recompute the computed (non-persistent) buffers in place: after `to_empty`."""
        self.positions.reset_table()

    def keep_only(self, keep: Sequence[BlockSpec]) -> M2M100Translation:
        """Drop every module not needed by the blocks in `keep` (in place; for a pipeline stage)."""
        keep_set = set(keep)
        for stack, kind in ((self.encoder, BlockKind.ENC_LAYER), (self.decoder, BlockKind.DEC_LAYER)):
            for key in list(stack.layers.keys()):
                if BlockSpec(kind, int(key)) not in keep_set:
                    del stack.layers[key]
        if BlockSpec(BlockKind.ENC_NORM) not in keep_set:
            self.encoder.layer_norm = None
        if BlockSpec(BlockKind.HEAD) not in keep_set:
            self.decoder.layer_norm = None
            self.lm_head = None
        if not any(b.uses_shared_embedding for b in keep):
            self.shared = None
        self.blocks = [b for b in self.blocks if b in keep_set]
        return self

    # --- blocks

    def block_parameters(self, blocks: Sequence[BlockSpec]) -> list[nn.Parameter]:
        """Parameters the given blocks use, each once, in block order (the tied embedding included)."""
        mods: list[nn.Module | None] = []
        for spec in blocks:
            if spec.kind is BlockKind.ENC_LAYER:
                mods.append(self.encoder.layers[str(spec.index)])
            elif spec.kind is BlockKind.DEC_LAYER:
                mods.append(self.decoder.layers[str(spec.index)])
            elif spec.kind is BlockKind.ENC_NORM:
                mods.append(self.encoder.layer_norm)
            elif spec.kind is BlockKind.HEAD:
                mods += [self.decoder.layer_norm, self.shared]
            else:
                mods.append(self.shared)
        out: dict[int, nn.Parameter] = {}
        for mod in mods:
            for p in mod.parameters() if mod is not None else ():
                out.setdefault(id(p), p)
        return list(out.values())

    def embed(self, ids: Tensor, offset: int = 0) -> Tensor:  # (B, T) -> (B, T, H)
        assert self.shared is not None
        return self.shared(ids) * self.embed_scale + self.positions(ids, offset)

    def run_block(self, spec: BlockSpec, state: State, batch: Seq2SeqBatch) -> State:
        """Apply one block: state in, state out (see the module docstring)."""
        src_mask = batch.key_mask(self.always_mask)  # None when no source row is padded (unless always)
        drop = self.config.dropout
        if spec.kind is BlockKind.SRC_EMBED:
            return {"hidden": F.dropout(self.embed(batch.input_ids), drop, self.training)}
        if self.skip_layers and self.training and spec.name in self.skip_layers:  # LayerDrop: identity
            return dict(state)
        if spec.kind is BlockKind.ENC_LAYER:
            layer = self.encoder.layers[str(spec.index)]
            if layer.is_sparse:
                return {"hidden": layer(state["hidden"], src_mask, self.moe_call(batch, decoder=False))}
            return {"hidden": layer(state["hidden"], src_mask)}
        if spec.kind is BlockKind.ENC_NORM:
            assert self.encoder.layer_norm is not None
            return {"encoder_out": self.encoder.layer_norm(state["hidden"])}
        if spec.kind is BlockKind.TGT_EMBED:
            hidden = F.dropout(self.embed(batch.decoder_input_ids), drop, self.training)
            return {"encoder_out": state["encoder_out"], "hidden": hidden}
        if spec.kind is BlockKind.DEC_LAYER:
            layer = self.decoder.layers[str(spec.index)]
            moe = self.moe_call(batch, decoder=True) if layer.is_sparse else None
            hidden = layer(state["hidden"], state["encoder_out"], src_mask, moe=moe)
            return {"encoder_out": state["encoder_out"], "hidden": hidden}
        assert (
            spec.kind is BlockKind.HEAD and self.decoder.layer_norm is not None and self.lm_head is not None
        )
        assert self.shared is not None
        return {"logits": self.lm_head(self.decoder.layer_norm(state["hidden"]), self.shared.weight)}

    def moe_call(self, batch: Seq2SeqBatch, decoder: bool) -> MoECall:
        """What a sparse layer routes this micro-batch with: its padding (source padding, or
        target positions holding the pad token, as fairseq's decoder), its slot and target tokens."""
        src, tgt = batch.lengths()
        if decoder:
            padded = bool(tgt) and min(tgt) < batch.decoder_input_ids.shape[1]
            pad = batch.decoder_input_ids.eq(self.config.pad_token_id) if padded else None
        else:
            key_mask = batch.src_key_mask
            pad = None if key_mask is None else ~key_mask
        return MoECall(pad=pad, slot=batch.slot, num_tokens=batch.num_tokens())

    def run_blocks(
        self,
        state: State,
        batch: Seq2SeqBatch,
        blocks: Sequence[BlockSpec] | None = None,
        around: Callable[[BlockSpec], AbstractContextManager[None]] | None = None,
    ) -> State:
        """Apply `blocks` (default: all) in order; `around(spec)`, when given, is entered around
        each block (a pipeline stage keys each block's dropout stream with it). One call for the
        whole run of blocks, so hooks on this method (FSDP's) see one forward per micro-batch."""
        for spec in self.blocks if blocks is None else blocks:
            with around(spec) if around is not None else nullcontext():
                state = self.run_block(spec, state, batch)
        return state

    def forward(self, batch: Seq2SeqBatch) -> Tensor:
        """Logits (B, T, V) of the whole model."""
        return self.run_blocks({}, batch)["logits"]

    def loss(self, batch: Seq2SeqBatch, label_smoothing: float = 0.0) -> tuple[Tensor, int]:
        """(sum of token losses, number of target tokens)."""
        return cross_entropy_sum(self(batch), batch.labels, label_smoothing), batch.num_tokens()

    # --- incremental decoding (generation)

    def encode(self, batch: Seq2SeqBatch) -> Tensor:
        state = self.run_blocks(
            {},
            batch,
            [
                b
                for b in self.blocks
                if b.kind in (BlockKind.SRC_EMBED, BlockKind.ENC_LAYER, BlockKind.ENC_NORM)
            ],
        )
        return state["encoder_out"]


def layerdrop_skips(config: ModelConfig, seed: int, step: int) -> frozenset[str]:
    """The encoder / decoder layers LayerDrop skips at optimizer step `step` (block names).

    One draw per step and layer from a generator keyed by (seed, step): the same on every
    rank, pipeline stage and micro-batch, so a step drops the same layers as one forward of
    the unsplit global batch would (HF draws per forward call; under gradient accumulation
    that would differ between micro-batches).
    """
    drop = {BlockKind.ENC_LAYER: config.encoder_layerdrop, BlockKind.DEC_LAYER: config.decoder_layerdrop}
    if not any(drop.values()):
        return frozenset()
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % (1 << 63))
    layers = [s for s in block_specs(config) if s.kind in drop]
    draws = torch.rand(len(layers), generator=g).tolist()
    return frozenset(s.name for s, u in zip(layers, draws) if u < drop[s.kind])
