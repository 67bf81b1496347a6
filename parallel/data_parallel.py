"""Data parallelism: one gradient reduction across dp replicas per optimizer step.

Each replica backpropagates `loss_sum / tokens(global batch)` over its own share
of the global batch, so the dp *sum* of gradients is the gradient of the mean
token loss of the whole batch: no division by dp, and the result does not depend
on how the batch is split. The reduction runs once, at the schedule's GR action
of the step's last flush (never inside gradient accumulation), over buckets of
flattened gradients (fewer, larger collectives: DDP's bucketing), each launched
asynchronously before any is waited on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def make_buckets(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters (in reverse order: backward produces the last layers' grads first) by dtype and size."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class GradReducer:
    """Sums `.grad` of `params` over the dp group (no-op when `group` is None)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.group = group
        self.buckets = make_buckets([p for p in params if p.requires_grad], bucket_bytes)

    def all_reduce(self) -> None:
        if self.group is None:
            return
        pending: list[tuple[list[nn.Parameter], Tensor, dist.Work]] = []
        for bucket in self.buckets:
            for p in bucket:
                if p.grad is None:  # a parameter this step did not touch still takes part
                    p.grad = torch.zeros_like(p)
            flat = _flatten_dense_tensors([p.grad for p in bucket])
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            assert work is not None
            pending.append((bucket, flat, work))
        for bucket, flat, work in pending:
            work.wait()
            grads = [p.grad for p in bucket if p.grad is not None]
            for grad, g in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(g)


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
            work.wait()
            for p, v in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                p.data.copy_(v)
