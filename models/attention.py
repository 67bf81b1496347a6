"""Multi-head attention with fused projections, and the KV cache of incremental decoding.

Written for one device; tensor parallelism swaps the projections from outside, so the
local head count is derived from the projections' width (see `Attention`). Each dropout site
of the model draws its mask inside a hook (`DropoutRng`) a runner may point at a stream of its
own (tp draws per rank: `parallel.tp.rng`); `dropout_at` is that draw.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# A dropout site's generator context: entered around the draw of its mask. `nullcontext`, the
# default, draws from torch's default generator.
DropoutRng = Callable[[], AbstractContextManager[object]]


def dropout_at(rng: DropoutRng, x: Tensor, p: float, training: bool) -> Tensor:
    """`F.dropout(x, p, training)` with its mask drawn inside the site's context `rng`."""
    if not training or p == 0.0:
        return x
    with rng():
        return F.dropout(x, p, True)


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
