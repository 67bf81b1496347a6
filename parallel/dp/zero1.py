"""ZeRO-1 (Rajbhandari et al. 2020): optimizer state sharded over the dp axis.

Gradients are still summed on every replica (`parallel.dp.reduce`); each replica then
steps only the parameters it owns and broadcasts them to the others, in buckets of at
most `bucket_bytes` (the reducer's `make_buckets`), at most `MAX_BUCKETS_IN_FLIGHT` of
them alive at once: the broadcast adds about two buckets to a rank's memory, not a
flattened copy of all its parameters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel import watchdog
from parallel.dp.reduce import DEFAULT_BUCKET_BYTES, MAX_BUCKETS_IN_FLIGHT, make_buckets


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
    updated values to the other replicas, one bucket of at most `bucket_bytes` at a
    time (`max_in_flight` broadcasts overlapping); `peak_in_flight_bytes` records the
    most flat bytes that were alive at once.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        max_in_flight: int = MAX_BUCKETS_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be >= 1")
        self.group, self.max_in_flight = group, max_in_flight
        self.dp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.owner = assign_owners(named, self.dp)
        by_name = dict(named)
        self.by_owner: list[list[nn.Parameter]] = [
            [by_name[n] for n, _ in named if self.owner[n] == r] for r in range(self.dp)
        ]
        # (owner, its parameters): the same list, in the same order, on every replica
        self.buckets = [
            (r, b) for r, params in enumerate(self.by_owner) for b in make_buckets(params, bucket_bytes)
        ]
        self.peak_in_flight_bytes = 0

    def owned(self) -> list[nn.Parameter]:
        return self.by_owner[self.rank]

    @torch.no_grad()
    def broadcast_updated(self) -> None:
        """After the optimizer step: every owner sends its parameters to the other replicas."""
        pending: deque[tuple[int, list[nn.Parameter], Tensor, dist.Work]] = deque()
        for r, params in self.buckets:
            while len(pending) >= self.max_in_flight:
                self._finish(*pending.popleft())
            if r == self.rank:
                flat = _flatten_dense_tensors([p.data for p in params])
            else:  # overwritten by the owner's values
                flat = torch.empty(
                    sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
                )
            src = dist.get_global_rank(self.group, r)
            work = dist.broadcast(flat, src=src, group=self.group, async_op=True)
            assert work is not None
            pending.append((r, params, flat, work))
            alive = sum(f.numel() * f.element_size() for _, _, f, _ in pending)
            self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, alive)
        while pending:
            self._finish(*pending.popleft())

    def _finish(self, owner: int, params: list[nn.Parameter], flat: Tensor, work: dist.Work) -> None:
        watchdog.wait(work, watchdog.collective("dp broadcast of ZeRO-1 updated parameters", self.group))
        if owner == self.rank:  # sent: the parameters already hold these values
            return
        for p, v in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
            p.data.copy_(v)
