"""ZeRO-1 (Rajbhandari et al. 2020): optimizer state sharded over the dp axis.

Gradients are still summed on every replica (`parallel.dp.reduce`); each replica then
steps only the parameters it owns and broadcasts them to the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel import watchdog


def assign_owners(named: Sequence[tuple[str, nn.Parameter]], dp: int) -> dict[str, int]:
    """ZeRO-1 ownership: each parameter's optimizer state lives on one dp rank.

    Largest first onto the least-loaded rank (ties by name), so every rank
    computes the same assignment without communication and loads are even.
    """
    load = [0] * dp
    owner: dict[str, int] = {}
    for name, p in sorted(named, key=lambda kv: (-kv[1].numel(), kv[0])):
        r = min(range(dp), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += p.numel()
    return owner


class ZeroOneSharding:
    """Optimizer-state sharding over the dp axis (ZeRO stage 1, Rajbhandari et al. 2020).

    Gradients are still all-reduced (every replica holds full gradients, so the
    global norm and clipping are unchanged); each replica then runs AdamW only on
    the parameters it owns, keeping 1/dp of the optimizer state, and broadcasts the
    updated values to the other replicas, one flattened bucket per owner.
    """

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], group: dist.ProcessGroup) -> None:
        self.group = group
        self.dp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.owner = assign_owners(named, self.dp)
        by_name = dict(named)
        self.by_owner: list[list[nn.Parameter]] = [
            [by_name[n] for n, _ in named if self.owner[n] == r] for r in range(self.dp)
        ]

    def owned(self) -> list[nn.Parameter]:
        return self.by_owner[self.rank]

    @torch.no_grad()
    def broadcast_updated(self) -> None:
        """After the optimizer step: every owner sends its parameters to the other replicas."""
        pending = []
        for r, params in enumerate(self.by_owner):
            if not params:
                continue
            flat = _flatten_dense_tensors([p.data for p in params])
            src = dist.get_global_rank(self.group, r)
            pending.append((params, flat, dist.broadcast(flat, src=src, group=self.group, async_op=True)))
        for params, flat, work in pending:
            assert work is not None
            watchdog.wait(work, watchdog.collective("dp broadcast of ZeRO-1 updated parameters", self.group))
            for p, v in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                p.data.copy_(v)
