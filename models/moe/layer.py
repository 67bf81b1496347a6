"""The sparse layer's FFN (`SparseFFN`: router, experts, dispatcher), the per-model run state
it reads (`MoERun`), the per-call inputs (`MoECall`), the aux loss's gradient (`AuxLossScaler`)
and the expert-load statistics it records."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor, nn

from models.config import ModelConfig
from models.moe.experts import Experts, GroupedRows, LocalDispatcher
from models.moe.router import Routing, Top2Router, keyed_generator


def decimal_ratio(f: float) -> tuple[int, int]:
    """`f` as the exact ratio of integers of the decimal it was written as (1.1 -> (11, 10))."""
    return Fraction(repr(f)).as_integer_ratio()


@dataclass
class MoERun:
    """What every sparse layer of one model reads besides its inputs: the run's options and
    the values set from outside once per optimizer step (`begin_step`).

    Attributes:
        dropless: route without capacity (no assignment ever dropped).
        capacity_factor: f in C = ceil(f * 2 * ceil(N / E)) (training capacity). Kept as its
            decimal's ratio of integers (`capacity_ratio`, exact: in floats 1.1 * 50 rounds up to 56):
            a float in the capacity's arithmetic is a symbolic float under torch.compile's dynamic
            shapes, in every shape guard after it (an NLLB-MoE layer pair compiled in 60 CPU-s, 40
            with the integers).
        aux_loss_coef: weight of the load-balancing loss (`router_aux_loss_coef`).
        seed, step: key the routing randomness together with the micro-batch and layer.
        loss_scale: what the step multiplies each micro-batch's loss sum by (1 / tokens of
            the global batch, or S / tokens under fp16): the aux loss's gradient follows it.
            0 (the default): the aux loss reaches no gradient. Any other float is kept as a 0-d
            float64 tensor.
        n_sparse_layers: sparse layers of the whole model (the aux loss is their mean).
    """

    dropless: bool = False
    capacity_ratio: tuple[int, int] = (1, 1)
    aux_loss_coef: float = 0.0
    seed: int = 0
    step: int = 0
    loss_scale: float | Tensor = 0.0
    n_sparse_layers: int = 1

    @property
    def capacity_factor(self) -> float:
        return self.capacity_ratio[0] / self.capacity_ratio[1]

    @capacity_factor.setter
    def capacity_factor(self, f: float) -> None:
        self.capacity_ratio = decimal_ratio(f)

    def begin_step(self, seed: int, step: int, loss_scale: float | Tensor) -> None:
        """Key this step's routing randomness and set the aux loss's gradient scale."""
        if isinstance(loss_scale, float) and loss_scale != 0.0:
            # A 0-d (host) tensor, not a float: a compiled layer would guard on the float's value
            # and recompile every step (`parallel.compile` specializes floats).
            loss_scale = torch.tensor(loss_scale, dtype=torch.float64)
        self.seed, self.step, self.loss_scale = seed, step, loss_scale


@dataclass(frozen=True)
class MoECall:
    """What one block call gives its sparse layer (built by the model from the micro-batch).

    Attributes:
        pad: (B, T) bool, True on padding (kept out of routing); None: nothing padded.
        slot: the micro-batch's slot in the global batch (keys the randomness and the stats).
        num_tokens: target tokens of the micro-batch (weights its aux loss, as fairseq's criterion).
    """

    pad: Tensor | None = None
    slot: int = 0
    num_tokens: int = 0


class AuxLossScaler(torch.autograd.Function):
    """Identity on `output` in forward; in backward also gives `aux` the gradient `scale`,
    so d(scale * aux) reaches the router where the layer runs (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux: Tensor, scale: float | Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        scale = ctx.scale
        g = torch.ones_like(aux) * (scale.to(aux.dtype) if isinstance(scale, Tensor) else scale)
        return grad, g, None


def working_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on `x` runs in: autocast's where it is on for `x`'s device, else `x`'s."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


@dataclass
class LayerStats:
    """One layer call's expert load (device tensors), recorded in training for the logs."""

    tokens_per_expert: Tensor  # (E,) assignments before capacity
    dropped: Tensor  # 0-d assignments dropped
    aux_loss: Tensor  # 0-d
    num_tokens: int  # target tokens of the micro-batch (the aux loss's weight)


@dataclass
class SparseSettings:
    """A sparse layer's fixed settings, from the model config."""

    num_experts: int
    eval_capacity_fraction: float = 1.0  # `moe_eval_capacity_token_fraction`
    token_dropout: float = 0.0  # `moe_token_dropout` (EOM)
    route_padding: bool = False  # `router_ignore_padding_tokens` (transformers' name: True routes padding)
    name: str = ""  # the layer's block name (keys its randomness)
    stats_enabled: bool = field(default=True)
    eval_ratio: tuple[int, int] = field(init=False)  # eval_capacity_fraction exactly (see `MoERun`)

    def __post_init__(self) -> None:
        self.eval_ratio = decimal_ratio(self.eval_capacity_fraction)


def build_sparse_ffn(c: ModelConfig, ffn_dim: int, name: str, run: MoERun, activation: Any) -> SparseFFN:
    """The sparse FFN of layer `name` (`encoder.layers.3`) of an NLLB-MoE config."""
    router = Top2Router(
        c.d_model,
        c.num_experts,
        bias=c.router_bias,
        dtype=c.router_dtype,
        second_expert_policy=c.second_expert_policy,
        normalize_before_dropping=c.normalize_router_prob_before_dropping,
        batch_prioritized=c.batch_prioritized_routing,
    )
    experts = Experts(c.d_model, ffn_dim, c.num_experts, activation, c.activation_dropout, c.dropout)
    settings = SparseSettings(
        num_experts=c.num_experts,
        eval_capacity_fraction=c.moe_eval_capacity_token_fraction,
        token_dropout=c.moe_token_dropout,
        route_padding=c.router_ignore_padding_tokens,
        name=name,
    )
    return SparseFFN(router, experts, settings, run)


class SparseFFN(nn.Module):
    """The sparse layer's FFN: `router` (Top2Router), `experts` (Experts), `dispatcher` (LocalDispatcher).

    Args:
        router, experts: the two modules with parameters.
        settings: E, the evaluation capacity, EOM, padding handling, the layer's name.
        run: the model's `MoERun` (shared by all its sparse layers).
    """

    def __init__(self, router: Top2Router, experts: Experts, settings: SparseSettings, run: MoERun) -> None:
        super().__init__()
        self.router, self.experts = router, experts
        self.dispatcher: Any = LocalDispatcher()
        self.settings, self.run = settings, run
        self.last_stats: dict[int, LayerStats] = {}  # micro-batch slot -> its load (training only)

    def capacity(self, n: int) -> int | None:
        """C for a group of `n` token slots, or None (no limit: dropless, or a C that cannot drop)."""
        s = self.settings
        if self.run.dropless:
            return None
        if not self.training and s.eval_ratio[0] > 0:
            c = -(-n * s.eval_ratio[0] // s.eval_ratio[1])  # ceil(fraction * n)
        else:
            num, den = self.run.capacity_ratio
            c = -(-2 * num * -(-n // s.num_experts) // den)  # ceil(f * 2 * ceil(n / E)), in integers
        return None if c >= n else c  # an expert takes at most n assignments: C >= n drops nothing

    def forward(self, x: Tensor, call: MoECall | None = None) -> Tensor:  # (B, T, H) -> (B, T, H)
        call = call if call is not None else MoECall()
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, H)
        pad = None if call.pad is None or self.settings.route_padding else call.pad.reshape(-1)
        run, name = self.run, self.settings.name
        gen = None
        if self.router.policy != "all":
            gen = keyed_generator(x.device, run.seed, "route", name, run.step, call.slot)
        routing = self.router(flat, pad, self.capacity(flat.shape[0]), generator=gen)
        routing = self._mask_outputs(routing, x.device, call)
        # The experts run in the run's working precision: the rows are cast once here, after the
        # (fp32) router, so the dispatch and its all-to-all move them in that dtype, the grouped
        # product sees it (autocast does not cover `_grouped_mm`) and the expert weights are cast
        # once per call (a no-op on the step's working copies).
        buffer, ctx = self.dispatcher.dispatch(flat.to(working_dtype(flat)), routing, self.experts)
        # The grouped layout only when the dispatcher chose it; experts modules are called with the
        # buffer alone otherwise (a tensor-parallel shard's forward takes just that).
        y = self.experts(buffer, ctx) if isinstance(ctx, GroupedRows) else self.experts(buffer)
        out = self.dispatcher.combine(y, routing, ctx)
        if self.training:
            self._record(routing, call)
            scale = self._aux_scale(call)
            if torch.is_grad_enabled() and not (isinstance(scale, float) and scale == 0.0):
                out = AuxLossScaler.apply(out, routing.aux_loss, scale)
        return out.view(shape)

    def _mask_outputs(self, routing: Routing, device: torch.device, call: MoECall) -> Routing:
        """EOM: drop whole (token, expert) outputs with p in training; scale by 1 - p in evaluation."""
        p = self.settings.token_dropout
        if p <= 0:
            return routing
        if not self.training:
            return routing.with_gate(routing.gate * (1.0 - p))
        run = self.run
        gen = keyed_generator(device, run.seed, "eom", self.settings.name, run.step, call.slot)
        u = torch.rand(routing.gate.shape, device=device, dtype=routing.gate.dtype, generator=gen)
        return routing.with_gate(routing.gate * (u > p))

    def _aux_scale(self, call: MoECall) -> float | Tensor:
        run = self.run
        return run.aux_loss_coef * call.num_tokens * run.loss_scale / max(run.n_sparse_layers, 1)

    def _record(self, routing: Routing, call: MoECall) -> None:
        if self.settings.stats_enabled:  # keyed by slot: a remat recomputation overwrites, never adds
            self.last_stats[call.slot] = LayerStats(
                routing.tokens_per_expert.detach(),
                routing.dropped.detach(),
                routing.aux_loss.detach(),
                call.num_tokens,
            )

    def pop_stats(self) -> list[LayerStats]:
        """The load recorded since the last call (one entry per micro-batch), cleared."""
        out = [self.last_stats[k] for k in sorted(self.last_stats)]
        self.last_stats.clear()
        return out
