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
projections are fused (q, k, v in one matmul; see `Attention`); `models.hf` maps
them to and from HF's separate tensors. Each dropout site draws inside a hook (`DropoutRng`)
a runner may point at a stream of its own (tp draws per rank: `parallel.tp.rng`).
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

from models.batch import Seq2SeqBatch as Seq2SeqBatch  # re-exported: importers name it from here
from models.config import ModelConfig
from models.init import LocalSlice, keyed_init
from models.loss import IGNORE_INDEX as IGNORE_INDEX  # re-exported too
from models.loss import cross_entropy_sum

State = dict[str, Tensor]

# A dropout site's generator context: entered around the draw of its mask. `nullcontext`, the
# default, draws from torch's default generator.
DropoutRng = Callable[[], AbstractContextManager[object]]


def dropout_at(rng: DropoutRng, x: Tensor, p: float, training: bool) -> Tensor:
    """`F.dropout(x, p, training)` with its mask drawn inside the site's context `rng`."""
    if not training or p == 0.0:
        return x
    with rng():
        return F.dropout(x, p, True)


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


class KVCache:
    """Keys and values of the tokens decoded so far, for one self-attention (incremental decoding)."""

    def __init__(self) -> None:
        self.k: Tensor | None = None  # (N, h, t, d)
        self.v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new tokens' keys/values; returns the whole prefix's."""
        if self.k is not None and self.v is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v

    def reorder(self, rows: Tensor) -> None:
        """Keep cache row `rows[n]` as row n (beam search follows the surviving beams)."""
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k[rows], self.v[rows]


class Attention(nn.Module):
    """Multi-head attention through `scaled_dot_product_attention`, with fused projections.

    Self-attention projects q, k and v with one matmul (`qkv_proj`, weight (3H, H));
    cross-attention projects q from the decoder (`q_proj`) and k, v from the encoder
    output with one matmul (`kv_proj`, (2H, H)). The fused weights' rows are grouped
    by head, as Megatron lays them out:

        qkv_proj rows   [q_0 k_0 v_0 | q_1 k_1 v_1 | ... ]   (d rows each, d = head dim)

    so a tensor-parallel split of the rows hands each rank whole heads with their q,
    k and v, and the local head count is rows // (3 d). `models.hf` converts to and
    from HF's separate q_proj / k_proj / v_proj at the import/export boundary.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float, cross: bool = False) -> None:
        super().__init__()
        self.head_dim = d_model // num_heads
        self.dropout, self.cross = dropout, cross
        self.dropout_rng: DropoutRng = nullcontext  # the attention-probability masks' generator
        if cross:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, y: Tensor, n: int) -> list[Tensor]:  # (B, T, h n d) -> n x (B, h, T, d)
        b, t, _ = y.shape
        return list(y.view(b, t, -1, n, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0))

    def project_kv(self, kv: Tensor) -> tuple[Tensor, Tensor]:  # (B, S, H) -> 2 x (B, h, S, d)
        """Cross-attention keys and values of the encoder output (cached once when decoding)."""
        k, v = self._heads(self.kv_proj(kv), 2)
        return k, v

    def forward(
        self,
        x: Tensor,  # (B, T, H)
        kv: Tensor | None = None,  # (B, S, H): the encoder output, for cross-attention
        key_mask: Tensor | None = None,  # (B, S) bool, True = attend
        causal: bool = False,
        cached_kv: tuple[Tensor, Tensor] | None = None,  # cross-attention k, v from `project_kv`
        cache: KVCache | None = None,  # self-attention: append this step's k, v and attend to all
    ) -> Tensor:
        b, t, _ = x.shape
        if self.cross:
            (q,) = self._heads(self.q_proj(x), 1)  # (B, h, T, d)
            k, v = cached_kv if cached_kv is not None else self.project_kv(x if kv is None else kv)
        else:
            q, k, v = self._heads(self.qkv_proj(x), 3)
            if cache is not None:  # one new token per step: no causal mask needed
                k, v = cache.append(k, v)
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, S)
        p = self.dropout if self.training else 0.0
        with self.dropout_rng() if p > 0.0 else nullcontext():
            out = F.scaled_dot_product_attention(  # a cache: one query per step, no causal mask
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal and mask is None and cache is None
            )
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class _LayerBranches(nn.Module):
    """What encoder and decoder layers share: the FFN and the residual branch, with their dropouts."""

    fc1: nn.Module
    fc2: nn.Module
    act: Callable[[Tensor], Tensor]
    dropout: float
    activation_dropout: float
    dropout_rng: DropoutRng  # residual-branch masks
    activation_dropout_rng: DropoutRng  # FFN-hidden masks

    def ffn(self, x: Tensor) -> Tensor:
        h = self.act(self.fc1(x))
        return self.fc2(dropout_at(self.activation_dropout_rng, h, self.activation_dropout, self.training))

    def residual(self, x: Tensor, h: Tensor) -> Tensor:
        """x + Drop(h)."""
        return x + dropout_at(self.dropout_rng, h, self.dropout, self.training)


class EncoderLayer(_LayerBranches):
    """Pre-LN: x + Drop(SelfAttn(LN(x))); x + Drop(FFN(LN(x)))."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c.d_model, c.encoder_attention_heads, c.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)
        self.act = ACT_FNS[c.activation_function]
        self.dropout, self.activation_dropout = c.dropout, c.activation_dropout
        self.dropout_rng = self.activation_dropout_rng = nullcontext

    def forward(self, x: Tensor, src_mask: Tensor | None) -> Tensor:
        x = self.residual(x, self.self_attn(self.self_attn_layer_norm(x), key_mask=src_mask))
        return self.residual(x, self.ffn(self.final_layer_norm(x)))


class DecoderLayer(_LayerBranches):
    """Pre-LN: causal self-attention, cross-attention on the encoder output, FFN."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c.d_model, c.decoder_attention_heads, c.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.encoder_attn = Attention(c.d_model, c.decoder_attention_heads, c.attention_dropout, cross=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.decoder_ffn_dim)
        self.fc2 = nn.Linear(c.decoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)
        self.act = ACT_FNS[c.activation_function]
        self.dropout, self.activation_dropout = c.dropout, c.activation_dropout
        self.dropout_rng = self.activation_dropout_rng = nullcontext

    def forward(
        self,
        x: Tensor,
        encoder_out: Tensor,
        src_mask: Tensor | None,
        self_cache: KVCache | None = None,
        cross_kv: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """`self_cache` and `cross_kv` are for incremental decoding (`models.generate`)."""
        x = self.residual(x, self.self_attn(self.self_attn_layer_norm(x), causal=True, cache=self_cache))
        h = self.encoder_attn(
            self.encoder_attn_layer_norm(x), kv=encoder_out, key_mask=src_mask, cached_kv=cross_kv
        )
        x = self.residual(x, h)
        return self.residual(x, self.ffn(self.final_layer_norm(x)))


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
        self.encoder = Stack((EncoderLayer(c) for _ in range(c.encoder_layers)), c.d_model)
        self.decoder = Stack((DecoderLayer(c) for _ in range(c.decoder_layers)), c.d_model)
        self.lm_head: nn.Module | None = LMHead()
        self.blocks: list[BlockSpec] = block_specs(c)
        self.skip_layers: frozenset[str] = frozenset()  # LayerDrop: block names skipped this step
        self.reset_parameters(seed)

    # --- construction helpers

    def init_value(self, name: str, part: LocalSlice, seed: int) -> Tensor:
        """Initial value (float32, CPU) of `part` of logical parameter `name` for `seed`:
        HF M2M100's distribution, drawn per parameter (`models.init.keyed_init`)."""
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
        src_mask = batch.src_key_mask  # None when no source row is padded
        drop = self.config.dropout
        if spec.kind is BlockKind.SRC_EMBED:
            return {"hidden": F.dropout(self.embed(batch.input_ids), drop, self.training)}
        if self.skip_layers and self.training and spec.name in self.skip_layers:  # LayerDrop: identity
            return dict(state)
        if spec.kind is BlockKind.ENC_LAYER:
            return {"hidden": self.encoder.layers[str(spec.index)](state["hidden"], src_mask)}
        if spec.kind is BlockKind.ENC_NORM:
            assert self.encoder.layer_norm is not None
            return {"encoder_out": self.encoder.layer_norm(state["hidden"])}
        if spec.kind is BlockKind.TGT_EMBED:
            hidden = F.dropout(self.embed(batch.decoder_input_ids), drop, self.training)
            return {"encoder_out": state["encoder_out"], "hidden": hidden}
        if spec.kind is BlockKind.DEC_LAYER:
            layer = self.decoder.layers[str(spec.index)]
            hidden = layer(state["hidden"], state["encoder_out"], src_mask)
            return {"encoder_out": state["encoder_out"], "hidden": hidden}
        assert (
            spec.kind is BlockKind.HEAD and self.decoder.layer_norm is not None and self.lm_head is not None
        )
        assert self.shared is not None
        return {"logits": self.lm_head(self.decoder.layer_norm(state["hidden"]), self.shared.weight)}

    def run_blocks(self, state: State, batch: Seq2SeqBatch, blocks: Sequence[BlockSpec] | None = None,
                   around: Callable[[BlockSpec], AbstractContextManager[None]] | None = None) -> State:  # fmt: skip
        """`blocks` (default: all) in order, each inside `around(spec)` if given (a stage keys its
        dropout so): one call per run of blocks, as hooks on this method (FSDP's) expect."""
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
