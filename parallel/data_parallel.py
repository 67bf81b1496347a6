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
            for p, g in zip(bucket, _unflatten_dense_tensors(flat, [p.grad for p in bucket])):
                p.grad.copy_(g)
