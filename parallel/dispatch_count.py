"""Counting what a region of code asks of the device: aten ops, and reads back to the host.

A read back (`.item()`, `float(t)`, `int(t)`, `bool(t)`, all of which dispatch
`aten::_local_scalar_dense`, and `Tensor.tolist`) makes the host wait for the
device to finish everything queued before it; inside a pipeline flush it stalls
the launch of the next micro-batch. Counted under a dispatch mode they are
testable on a CPU, where they cost nothing, so a regression shows up in CI and
not only on a GPU. The op count is the host's launch work, the other half of
host overhead per micro-batch.

    with DispatchCounter() as c:
        pm.train_step(...)
    c.host_reads, c.num_ops, c.ops.most_common(10)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READ_OPS = frozenset({"aten._local_scalar_dense.default"})


class DispatchCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it (forward and autograd's backward) and host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.tolist_calls = 0
        self._tolist: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> DispatchCounter:
        original = self._tolist = torch.Tensor.tolist

        def counted_tolist(t: torch.Tensor) -> Any:
            self.tolist_calls += 1
            return original(t)

        torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]

    @property
    def host_reads(self) -> int:
        """Device-to-host reads: scalar reads plus `tolist` calls."""
        return sum(n for op, n in self.ops.items() if op in _READ_OPS) + self.tolist_calls

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())
