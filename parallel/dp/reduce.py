"""Data parallelism: one gradient reduction across dp replicas per optimizer step.

Each replica backpropagates `loss_sum / tokens(global batch)` over its own share
of the global batch, so the dp *sum* of gradients is the gradient of the mean
token loss of the whole batch: no division by dp, and the result does not depend
on how the batch is split. The reduction runs once, at the schedule's GR action
of the step's last flush (never inside gradient accumulation), over buckets of
flattened gradients (fewer, larger collectives: DDP's bucketing). Buckets whose
gradients are final are launched during the last micro-batch's backward, so the
communication overlaps the rest of that backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel import watchdog

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# Flat bucket copies alive at once: one reducing while the next is filled and launched.
MAX_BUCKETS_IN_FLIGHT = 2


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
    """Sums `.grad` over the dp group (no-op when `group` is None), optionally overlapped.

    Overlap (DDP-style): during the last backward of a stage in the step's last
    flush (`arm(stage)`), a post-accumulate-grad hook marks each parameter done;
    a bucket whose parameters are all done is flattened and its all-reduce
    launched asynchronously while the backward continues. Buckets launch in one
    fixed order on every replica (a ready bucket waits for the ones before it),
    since collectives on a group match by order. `all_reduce()` at GR launches
    what is left (e.g. parameters that got no gradient) and waits for everything.
    Parameters in `exclude` (the tied embedding, written by several blocks) are
    always reduced at GR. At most `max_in_flight` buckets are in flight: launching
    another first finishes the oldest (its flat copy is summed back into `.grad` and
    freed); `peak_in_flight` records the most there were.
    """

    def __init__(
        self,
        params_by_stage: Sequence[Sequence[nn.Parameter]],
        group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        exclude: Sequence[nn.Parameter] = (),
        max_in_flight: int = MAX_BUCKETS_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be >= 1")
        self.group, self.max_in_flight = group, max_in_flight
        skip = {id(p) for p in exclude}
        self.buckets: list[list[nn.Parameter]] = []
        self.stage_of_bucket: list[int] = []
        seen: set[int] = set()
        for stage, params in enumerate(params_by_stage):
            mine = [p for p in params if p.requires_grad and id(p) not in seen and id(p) not in skip]
            seen.update(id(p) for p in mine)
            for bucket in make_buckets(mine, bucket_bytes):
                self.buckets.append(bucket)
                self.stage_of_bucket.append(stage)
        rest = [p for params in params_by_stage for p in params if p.requires_grad and id(p) in skip]
        rest = list({id(p): p for p in rest}.values())
        if rest:
            self.buckets.append(rest)
            self.stage_of_bucket.append(-1)
        self.overlap = overlap and group is not None
        self._bucket_of = {
            id(p): i for i, b in enumerate(self.buckets) for p in b if self.stage_of_bucket[i] >= 0
        }
        self._armed: set[int] = set()
        self._done: list[set[int]] = [set() for _ in self.buckets]
        self._ready: set[int] = set()
        self._next = 0
        self._pending: deque[tuple[int, Tensor, dist.Work]] = deque()
        self.launched_during_backward = 0
        self.peak_in_flight = 0  # most flat bucket copies alive at once (bounded by max_in_flight)
        if self.overlap:
            for p in self._all_params():
                if id(p) in self._bucket_of:
                    p.register_post_accumulate_grad_hook(self._on_grad)

    def _all_params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b]

    def arm(self, stage: int) -> None:
        """The next backward is `stage`'s last of the step: launch its buckets as they fill."""
        if self.overlap:
            self._armed.add(stage)

    def _on_grad(self, p: nn.Parameter) -> None:
        i = self._bucket_of.get(id(p))
        if i is None or self.stage_of_bucket[i] not in self._armed:
            return
        self._done[i].add(id(p))
        if len(self._done[i]) == len(self.buckets[i]):
            self._ready.add(i)
            while self._next in self._ready:
                self._launch(self._next)
                self.launched_during_backward += 1

    def _launch(self, i: int) -> None:
        assert self.group is not None
        while len(self._pending) >= self.max_in_flight:
            self._finish_oldest()
        bucket = self.buckets[i]
        for p in bucket:
            if p.grad is None:  # a parameter this step did not touch still takes part
                p.grad = torch.zeros_like(p)
        flat = _flatten_dense_tensors([p.grad for p in bucket])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        assert work is not None
        self._pending.append((i, flat, work))
        self.peak_in_flight = max(self.peak_in_flight, len(self._pending))
        self._ready.discard(i)
        self._next = i + 1

    def _finish_oldest(self) -> None:
        """Wait for the oldest bucket in flight, copy its sums into `.grad` and drop its flat copy."""
        i, flat, work = self._pending.popleft()
        watchdog.wait(work, watchdog.collective(f"dp all-reduce of gradient bucket {i}", self.group))
        grads = [p.grad for p in self.buckets[i] if p.grad is not None]
        for grad, g in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(g)

    def all_reduce(self) -> None:
        """Launch the buckets not launched yet, in order, and wait for all of them."""
        if self.group is None:
            return
        while self._next < len(self.buckets):
            self._launch(self._next)
        while self._pending:
            self._finish_oldest()
        self._armed.clear()
        self._done = [set() for _ in self.buckets]
        self._ready.clear()
        self._next = 0
