"""fairseq's NLLB top-2 gate (`fairseq/modules/moe/top2gate.py`, branch nllb) as `Top2Router`,
and the `Routing` it returns (see `models.moe` for the semantics)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.init import stable_seed


@dataclass
class Routing:
    """One routing group's assignments (N tokens, 2 choices each).

    Attributes:
        expert_index: (N, 2) long, the global expert of each choice.
        gate: (N, 2) float, combine weights; 0 where dropped or padding.
        slot: (N, 2) long, position in the expert's capacity buffer; -1 if dropped or padding.
        aux_loss: 0-d fp32, the load-balancing loss (pre-capacity).
        tokens_per_expert: (E,) long, assignments per expert before capacity (padding excluded).
        dropped: 0-d long, assignments dropped by capacity.
        capacity: C, or None without a limit (the dispatcher sizes its buffer from the counts).
    """

    expert_index: Tensor
    gate: Tensor
    slot: Tensor
    aux_loss: Tensor
    tokens_per_expert: Tensor
    dropped: Tensor
    capacity: int | None

    def with_gate(self, gate: Tensor) -> Routing:
        """The same assignments with other combine weights (expert output masking)."""
        return Routing(
            self.expert_index,
            gate,
            self.slot,
            self.aux_loss,
            self.tokens_per_expert,
            self.dropped,
            self.capacity,
        )


def _one_hot(index: Tensor, classes: int) -> Tensor:
    """(N,) -> (N, classes) long; `F.one_hot` would read the indices back to check their range."""
    return torch.zeros(index.shape[0], classes, dtype=torch.long, device=index.device).scatter_(
        1, index[:, None], 1
    )


def _positions(mask: Tensor, order: Tensor | None) -> Tensor:
    """(N, E) 0/1 -> (N, E): each token's position among the tokens routed to the same expert,
    counted in token order or in `order` (a permutation of the tokens)."""
    if order is None:
        return torch.cumsum(mask, dim=0) - 1
    out = torch.empty_like(mask)
    out[order] = torch.cumsum(mask[order], dim=0) - 1
    return out


class Top2Router(nn.Module):
    """fairseq's NLLB top-2 gate (see the module docstring); `classifier` named as transformers'.

    Args:
        d_model, num_experts: H and E.
        bias: `router_bias`.
        dtype: `router_dtype` (the classifier and softmax run in it, autocast off).
        second_expert_policy: 'all', 'sampling' or 'random'.
        normalize_before_dropping: `normalize_router_prob_before_dropping`.
        batch_prioritized: `batch_prioritized_routing` (capacity goes to the most confident tokens).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        bias: bool = False,
        dtype: str = "float32",
        second_expert_policy: str = "all",
        normalize_before_dropping: bool = False,
        batch_prioritized: bool = False,
    ) -> None:
        super().__init__()
        self.classifier = nn.Linear(d_model, num_experts, bias=bias)
        self.num_experts = num_experts
        self.dtype: torch.dtype = getattr(torch, dtype)
        # Mixed precision keeps these weights in the router dtype, not in the working one
        # (as transformers' `_keep_in_fp32_modules`): an fp32 router reads fp32 weights however
        # the run casts the rest (`parallel.mixed_precision.keeps_fp32`).
        self.classifier.keep_in_fp32 = self.dtype == torch.float32
        self.policy = second_expert_policy
        self.normalize_before_dropping = normalize_before_dropping
        self.batch_prioritized = batch_prioritized

    def logits(self, x: Tensor) -> Tensor:  # (N, H) -> (N, E) in the router dtype
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(self.dtype)
            if self.classifier.weight.dtype == self.dtype:
                return self.classifier(x)  # a module call: what a per-module weight gather hooks on
            w = self.classifier.weight.to(self.dtype)
            b = None if self.classifier.bias is None else self.classifier.bias.to(self.dtype)
            return F.linear(x, w, b)

    def forward(
        self,
        x: Tensor,  # (N, H)
        pad: Tensor | None = None,  # (N,) bool, True = padding
        capacity: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Routing:
        """Route the group's N tokens; `capacity` None = no limit; `generator` draws the
        `sampling` / `random` policies' noise (the global generator if None)."""
        logits = self.logits(x)
        probs = torch.softmax(logits, dim=-1)  # (N, E)
        n, e = probs.shape
        idx1 = probs.argmax(dim=-1)  # (N,)
        second = logits
        if self.policy == "sampling":  # Gumbel-max: a sample of the softmax over the others
            noise = torch.empty_like(logits).exponential_(generator=generator).log_().neg_()
            second = logits + noise
        idx2 = second.scatter(1, idx1[:, None], float("-inf")).argmax(dim=-1)  # (N,)
        g1, g2 = probs.gather(1, idx1[:, None])[:, 0], probs.gather(1, idx2[:, None])[:, 0]
        if self.normalize_before_dropping:
            denom = (g1 + g2).clamp(min=torch.finfo(probs.dtype).eps)
            g1, g2 = g1 / denom, g2 / denom
        real = torch.ones(n, dtype=torch.bool, device=x.device) if pad is None else ~pad
        use2 = real
        if self.policy == "random":  # keep the second choice with probability 2 g_2
            u = torch.rand(n, device=x.device, dtype=g2.dtype, generator=generator)
            use2 = real & (2 * g2.detach() > u)
        mask1 = _one_hot(idx1, e) * real[:, None]  # (N, E) long
        mask2 = _one_hot(idx2, e) * use2[:, None]
        order = None
        if self.batch_prioritized:  # most confident first (stable: ties keep token order)
            order = torch.argsort(-probs.detach().max(dim=-1).values, stable=True)
        count1 = mask1.sum(dim=0)  # (E,)
        loc1 = _positions(mask1, order).gather(1, idx1[:, None])[:, 0]
        loc2 = _positions(mask2, order).gather(1, idx2[:, None])[:, 0] + count1[idx2]
        keep1, keep2 = real, use2
        if capacity is not None:
            keep1, keep2 = keep1 & (loc1 < capacity), keep2 & (loc2 < capacity)
        g1, g2 = g1 * keep1, g2 * keep2
        if not self.normalize_before_dropping:
            denom = (g1 + g2).clamp(min=torch.finfo(probs.dtype).eps)
            g1, g2 = g1 / denom, g2 / denom
        n_real = real.sum().clamp(min=1)
        me = (probs * real[:, None]).sum(dim=0) / n_real  # mean gate per expert
        ce = count1.to(probs.dtype) / n_real  # fraction of top-1 choices per expert
        aux = (me * ce).mean() * e * e
        assigned = torch.stack([real, use2], dim=1)  # (N, 2)
        kept = torch.stack([keep1, keep2], dim=1)
        return Routing(
            expert_index=torch.stack([idx1, idx2], dim=1),
            gate=torch.stack([g1, g2], dim=1),
            slot=torch.where(kept, torch.stack([loc1, loc2], dim=1), -1),
            aux_loss=aux.float(),
            tokens_per_expert=count1 + mask2.sum(dim=0),
            dropped=(assigned & ~kept).sum(),
            capacity=capacity,
        )


# ----------------------------------------------------------------------------- keyed randomness


def keyed_generator(device: torch.device, seed: int, *key: object) -> torch.Generator:
    """A generator on `device` seeded from (seed, key...), the same in every process."""
    g = torch.Generator(device=device)
    g.manual_seed(stable_seed(seed, "/".join(str(k) for k in key)))
    return g
