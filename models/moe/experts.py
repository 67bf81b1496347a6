"""Stacked expert FFNs computed in one batched call, and the local dispatcher that gathers
tokens into their (experts, capacity, d) buffer and back."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.moe.router import Routing


def _grouped_mm_ok(x: Tensor) -> bool:
    """`torch._grouped_mm` runs (forward and backward) on CUDA sm90+ in bf16; a batched matmul elsewhere."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def batched_linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """(E, C, in) x (E, out, in) + (E, out) -> (E, C, out): each expert's `F.linear`, in one call."""
    if _grouped_mm_ok(x):
        return torch._grouped_mm(x, weight.to(x.dtype).transpose(-2, -1)) + bias.to(x.dtype)[:, None, :]
    return torch.baddbmm(bias[:, None, :].to(x.dtype), x, weight.to(x.dtype).transpose(1, 2))


class Experts(nn.Module):
    """`E_l` expert FFNs with stacked parameters: fc1 -> activation -> activation dropout ->
    fc2 -> dropout, as fairseq's experts (its `FeedForwardNetwork` drops each expert's output
    with `dropout`; the sparse layer adds no residual dropout of its own).

    Parameters (names mapped to transformers' `experts.expert_<e>.fc1.weight` by
    `expert_param_name`): fc1_weight (E_l, F, H), fc1_bias (E_l, F), fc2_weight (E_l, H, F),
    fc2_bias (E_l, H). `num_experts` is the global E, `expert_offset` the global index of
    the first local expert (0 on one process).
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        num_experts: int,
        activation: Any,
        activation_dropout: float = 0.0,
        dropout: float = 0.0,
        local: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        lo, hi = local if local is not None else (0, num_experts)
        n = hi - lo
        self.num_experts, self.expert_offset = num_experts, lo
        self.fc1_weight = nn.Parameter(torch.empty(n, ffn_dim, d_model))
        self.fc1_bias = nn.Parameter(torch.zeros(n, ffn_dim))
        self.fc2_weight = nn.Parameter(torch.empty(n, d_model, ffn_dim))
        self.fc2_bias = nn.Parameter(torch.zeros(n, d_model))
        self.act, self.activation_dropout, self.dropout = activation, activation_dropout, dropout

    @property
    def num_local(self) -> int:
        return int(self.fc1_weight.shape[0])

    def forward(self, x: Tensor) -> Tensor:  # (E_l, C, H) -> (E_l, C, H)
        h = self.act(batched_linear(x, self.fc1_weight, self.fc1_bias))  # (E_l, C, F)
        h = F.dropout(h, self.activation_dropout, self.training)
        return F.dropout(batched_linear(h, self.fc2_weight, self.fc2_bias), self.dropout, self.training)


class LocalDispatcher:
    """Gathers tokens into the (E_l, C, H) buffer of `experts` and back, on one process (E_l = E).

    A buffer slot (e, c) holds the token whose choice k went to expert e at slot c; empty
    slots read a zero row. Dropped assignments (slot -1) point at a trash row. Both
    directions are index gathers (their gradients scatter-add), with no host read unless the
    routing has no capacity (then C = the largest expert count, read once).
    """

    def capacity(self, routing: Routing) -> int:
        if routing.capacity is not None:
            return routing.capacity
        return max(1, int(routing.tokens_per_expert.max()))  # dropless: the one host read

    def dispatch(self, x: Tensor, routing: Routing, experts: Experts) -> tuple[Tensor, Tensor]:
        """x (N, H) -> (buffer (E_l, C, H), ctx: the flat buffer row of each choice (N, 2))."""
        n, h = x.shape
        e_local, c = experts.num_local, self.capacity(routing)
        local = routing.expert_index - experts.expert_offset
        ok = (routing.slot >= 0) & (local >= 0) & (local < e_local)
        trash = e_local * c
        rows = torch.where(ok, local * c + routing.slot, trash)  # (N, 2)
        token = torch.arange(n, device=x.device).repeat_interleave(2)  # (2N,)
        source = torch.full((trash + 1,), n, dtype=torch.long, device=x.device)
        source.scatter_(0, rows.reshape(-1), token)  # buffer row -> token (n: empty)
        x_ext = torch.cat([x, x.new_zeros(1, h)])  # (N + 1, H)
        return x_ext.index_select(0, source[:trash]).view(e_local, c, h), rows

    def combine(self, y: Tensor, routing: Routing, ctx: Tensor) -> Tensor:
        """y (E_l, C, H) -> (N, H): sum over the two choices of gate * expert output."""
        h = y.shape[-1]
        y_ext = torch.cat([y.reshape(-1, h), y.new_zeros(1, h)])  # (E_l C + 1, H)
        picked = y_ext.index_select(0, ctx.reshape(-1)).view(*ctx.shape, h)  # (N, 2, H)
        return (picked.float() * routing.gate.unsqueeze(-1).float()).sum(dim=1).to(y.dtype)
