"""Stacked expert FFNs computed together, and the local dispatcher that hands them their tokens.

Two layouts, the same results:

    buffer   (E_l, C, H): slot (e, c) holds the token of expert e's c-th assignment (empty
             slots are zero rows); each projection is one `torch.baddbmm` over all experts.
             The contract's layout: an all-to-all dispatcher exchanges these buffers.
    grouped  (2N, H): the group's assignments sorted by expert, kept ones first; each
             projection is one `torch._grouped_mm` over the row groups (offsets on the device),
             so empty capacity slots and dropped assignments cost nothing and dropless routing
             needs no host read. Where `_grouped_mm` runs: on CPUs its forward kernels (its own
             backward is missing there: `GroupedLinear` computes the gradients with three
             grouped products), on CUDA sm90+ in bf16 (not exercised in this repository's tests:
             no GPU), elsewhere the buffer.

Legend: N tokens of the routing group, H d_model, F ffn dim, E_l local experts, C capacity,
M = 2N assignment rows.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import DropoutRng, dropout_at
from models.moe.router import Routing


def grouped_mm_runs(x: Tensor) -> bool:
    """Whether `torch._grouped_mm` runs for activations like `x`: CPUs (forward kernels, our
    backward), CUDA sm90+ in bf16. Traced by `torch.compile`, fp32 takes the buffer: the op's
    meta function, which dynamo traces with, refuses anything but bf16 (the CPU kernel does not)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        if x.dtype == torch.float32 and torch.compiler.is_compiling():
            return False
        return x.dtype in (torch.float32, torch.bfloat16)
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


def grouped_mm_aligned(x: Tensor, experts: Any) -> bool:
    """Whether `torch._grouped_mm` takes these shapes: every row stride (H and F elements of
    `x`'s dtype) a multiple of 16 bytes (H 2048 and F 8192 are; a tiny test model's F 20 in
    bf16 is not)."""
    size = x.element_size()
    return all(d * size % 16 == 0 for d in (x.shape[-1], experts.fc1_weight.shape[1]))


def grouped_layout(x: Tensor, experts: Any) -> bool:
    """The grouped layout for rows like `x` and these experts: where `torch._grouped_mm` runs, on
    shapes it takes, for experts whose forward takes groups (`takes_groups`)."""
    return grouped_mm_runs(x) and takes_groups(experts) and grouped_mm_aligned(x, experts)


def batched_linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """(E, C, in) x (E, out, in) + (E, out) -> (E, C, out): each expert's `F.linear`, in one call.

    Computed as (W x^T)^T, so the weight's gradient comes out of the backward contiguous in the
    parameter's (E, out, in) layout (x W^T would give its transpose, which autograd then copies:
    measured 1.8x slower for fwd + bwd on a CPU at E 32, C 48, 256 -> 1024). The result is a
    transposed view; the next batched matmul reads it as it is.
    """
    w = weight.to(x.dtype)
    return torch.baddbmm(bias.to(x.dtype)[:, :, None], w, x.transpose(1, 2)).transpose(1, 2)


@dataclass
class GroupedRows:
    """The grouped layout of one routing group's assignments (see the module docstring).

    Attributes:
        offs: (E_l,) int32, end row of each local expert's group (cumulative counts).
        expert: (M,) long, the local expert of each row (rows past offs[-1]: clamped, unused).
        valid: (M,) bool, rows inside a group (the others hold dropped assignments).
        inverse: (N, 2) long, the row of each token's choice k.
    """

    offs: Tensor
    expert: Tensor
    valid: Tensor
    inverse: Tensor


class GroupedLinear(torch.autograd.Function):
    """y_r = W_{e(r)} x_r + b_{e(r)} for the rows of each expert group, 0 past the groups, with
    `torch._grouped_mm` in both directions:

        dX = dY W (per group),  dW_e = dY_e^T X_e (grouped along the rows),  db_e = sum_r dY_r
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, groups: GroupedRows) -> Tensor:  # type: ignore[override]
        w = weight.to(x.dtype)
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=groups.offs)  # (M, out)
        y = y + bias.to(x.dtype).index_select(0, groups.expert)
        ctx.save_for_backward(x, w)
        ctx.groups, ctx.weight_dtype = groups, weight.dtype
        return torch.where(groups.valid[:, None], y, 0.0)  # rows past the groups are uninitialised

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        g: GroupedRows = ctx.groups
        grad = torch.where(g.valid[:, None], grad, 0.0).contiguous()
        dx = torch.where(g.valid[:, None], torch._grouped_mm(grad, w, offs=g.offs), 0.0)
        dw = torch._grouped_mm(grad.t(), x, offs=g.offs)  # (E_l, out, in)
        db = grad.new_zeros(w.shape[0], w.shape[1]).index_add_(0, g.expert, grad)
        return dx, dw.to(ctx.weight_dtype), db.to(ctx.weight_dtype), None


class Experts(nn.Module):
    """`E_l` expert FFNs with stacked parameters: fc1 -> activation -> activation dropout ->
    fc2 -> dropout, as fairseq's experts (its `FeedForwardNetwork` drops each expert's output
    with `dropout`; the sparse layer adds no residual dropout of its own).

    Parameters (names mapped to transformers' `experts.expert_<e>.fc1.weight` by
    `expert_param_name`): fc1_weight (E_l, F, H), fc1_bias (E_l, F), fc2_weight (E_l, H, F),
    fc2_bias (E_l, H). `num_experts` is the global E, `expert_offset` the global index of
    the first local expert (0 on one process). The FFN-hidden dropout draws inside the hook
    `activation_dropout_rng` (`models.attention.DropoutRng`), as a dense layer's does: tp points
    it at a per-rank stream (`parallel.tp.rng`), each expert's F dim being split over tp.
    """

    # A class default: the tp shards `parallel.expert.apply` builds with `__new__` have it too.
    activation_dropout_rng: DropoutRng = nullcontext

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

    def forward(self, x: Tensor, groups: GroupedRows | None = None) -> Tensor:
        """The buffer (E_l, C, H) -> (E_l, C, H); or, given `groups`, rows (M, H) sorted by
        expert -> (M, H) (zero past the groups)."""
        if groups is None:
            h = self.act(batched_linear(x, self.fc1_weight, self.fc1_bias))  # (E_l, C, F)
        else:
            h = self.act(GroupedLinear.apply(x, self.fc1_weight, self.fc1_bias, groups))  # (M, F)
        h = dropout_at(self.activation_dropout_rng, h, self.activation_dropout, self.training)
        if groups is None:
            y = batched_linear(h, self.fc2_weight, self.fc2_bias)
        else:
            y = GroupedLinear.apply(h, self.fc2_weight, self.fc2_bias, groups)
        return F.dropout(y, self.dropout, self.training)


def takes_groups(experts: Any) -> bool:
    """Whether `experts.forward` takes the grouped layout: `Experts`' own forward, or a class that
    says so itself (`supports_groups = True` in its body); a subclass overriding `forward` (a
    tensor-parallel shard) is given the buffer."""
    cls = type(experts)
    return getattr(cls, "forward", None) is Experts.forward or bool(
        cls.__dict__.get("supports_groups", False)
    )


class LocalDispatcher:
    """Hands `experts` their tokens and back, on one process (E_l = E): grouped rows where
    `torch._grouped_mm` runs (`grouped` None: decided per call), else the (E_l, C, H) buffer.

    Buffer: slot (e, c) holds the token whose choice k went to expert e at slot c; empty slots
    read a zero row; dropped assignments (slot -1) point at a trash row. Grouped: the 2N
    choices sorted by local expert (dropped ones last, past the groups). Both directions are
    index gathers (their gradients scatter-add). No host read, except the buffer without a
    capacity (dropless): C = the largest expert count, read once.
    """

    grouped: bool | None = None  # a class default too: subclasses need not call __init__

    def __init__(self, grouped: bool | None = None) -> None:
        self.grouped = grouped

    def use_groups(self, x: Tensor, experts: Any) -> bool:
        """The grouped layout: where `torch._grouped_mm` runs (or as forced), on shapes it takes,
        and only for experts that take it (`grouped_layout`)."""
        if self.grouped is None:
            return grouped_layout(x, experts)
        return self.grouped and takes_groups(experts) and grouped_mm_aligned(x, experts)

    def capacity(self, routing: Routing) -> int:
        if routing.capacity is not None:
            return routing.capacity
        return max(1, int(routing.tokens_per_expert.max()))  # dropless: the one host read

    def dispatch(self, x: Tensor, routing: Routing, experts: Experts) -> tuple[Tensor, Any]:
        """x (N, H) -> (buffer (E_l, C, H), ctx: the flat buffer row of each choice (N, 2)), or
        (rows (2N, H), ctx: `GroupedRows`)."""
        if self.use_groups(x, experts):
            return self._dispatch_grouped(x, routing, experts)
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

    def _dispatch_grouped(self, x: Tensor, routing: Routing, experts: Experts) -> tuple[Tensor, GroupedRows]:
        n, e_local = x.shape[0], experts.num_local
        local = routing.expert_index - experts.expert_offset
        ok = (routing.slot >= 0) & (local >= 0) & (local < e_local)
        key = torch.where(ok, local, e_local).reshape(-1)  # (2N,): expert, or e_local = dropped
        order = torch.argsort(key, stable=True)  # rows by expert, dropped last
        counts = torch.zeros(e_local + 1, dtype=torch.long, device=x.device).scatter_add_(
            0, key, torch.ones_like(key)
        )
        offs = torch.cumsum(counts[:e_local], 0).to(torch.int32)
        rows = torch.arange(2 * n, device=x.device)
        inverse = torch.empty_like(order).scatter_(0, order, rows)
        groups = GroupedRows(
            offs=offs,
            expert=key[order].clamp(max=max(e_local - 1, 0)),
            valid=rows < offs[-1],
            inverse=inverse.view(n, 2),
        )
        return x.index_select(0, order // 2), groups

    def combine(self, y: Tensor, routing: Routing, ctx: Any) -> Tensor:
        """y (E_l, C, H) or (2N, H) grouped -> (N, H): sum over the two choices of gate * expert output."""
        h = y.shape[-1]
        if isinstance(ctx, GroupedRows):
            picked = y.index_select(0, ctx.inverse.reshape(-1)).view(*ctx.inverse.shape, h)  # (N, 2, H)
        else:
            y_ext = torch.cat([y.reshape(-1, h), y.new_zeros(1, h)])  # (E_l C + 1, H)
            picked = y_ext.index_select(0, ctx.reshape(-1)).view(*ctx.shape, h)  # (N, 2, H)
        return (picked.float() * routing.gate.unsqueeze(-1).float()).sum(dim=1).to(y.dtype)
