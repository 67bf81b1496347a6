"""Counting what a region of code asks of the device: aten ops, and reads back to the host.

A read back (`.item()`, `float(t)`, `int(t)`, `bool(t)`, all of which dispatch
`aten::_local_scalar_dense`, and `Tensor.tolist`) makes the host wait for the
device to finish everything queued before it; inside a pipeline flush it stalls
the launch of the next micro-batch. Counted under a dispatch mode they are
testable on a CPU, where they cost nothing, so a regression shows up in CI and
not only on a GPU. The op count is the host's launch work, the other half of
host overhead per micro-batch.

Compiled regions (`torch_compile`) run compiled inside the counter: their extern calls
(matmuls, attention) dispatch through it, and the kernels inductor generated, which do not,
are counted from the generated code of each graph that runs (`kernels`; on a GPU each is
a launch, as each eager op is).

    with DispatchCounter() as c:
        pm.train_step(...)
    c.host_reads, c.num_ops, c.ops.most_common(10), c.kernels
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READ_OPS = frozenset({"aten._local_scalar_dense.default"})
# A kernel call in inductor's generated wrapper: `cpp_fused_add_0(...)` (CPU), `triton_poi_..run(` (CUDA).
_KERNEL_CALL = re.compile(r"^\s+(?:cpp_fused_\w+\(|triton_\w+\.run\()", re.MULTILINE)


def _kernels_in(graph: Any) -> int:
    """Kernel calls in one compiled graph's generated wrapper (counted once per graph)."""
    count = getattr(graph, "_counted_kernels", None)
    if count is None:
        count = len(_KERNEL_CALL.findall(getattr(graph, "source_code", "") or ""))
        graph._counted_kernels = count
    return int(count)


class DispatchCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it (forward and autograd's backward) and host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.tolist_calls = 0
        self.kernels = 0  # calls of inductor-generated kernels (compiled regions)
        self.graph_calls = 0  # compiled graphs run (forward and backward each count)
        self._tolist: Any = None
        self._graph_call: Any = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let dynamo run compiled regions under this mode (it runs them eagerly under others)."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> DispatchCounter:
        original = self._tolist = torch.Tensor.tolist

        def counted_tolist(t: torch.Tensor) -> Any:
            self.tolist_calls += 1
            return original(t)

        torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign,assignment]
        output_code = sys.modules.get("torch._inductor.output_code")  # imported once anything compiled
        if output_code is not None:
            graph_cls = output_code.CompiledFxGraph
            run = self._graph_call = graph_cls.__call__

            def counted_call(graph: Any, inputs: Any) -> Any:
                self.graph_calls += 1
                self.kernels += _kernels_in(graph)
                return run(graph, inputs)

            graph_cls.__call__ = counted_call
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        if self._graph_call is not None:
            sys.modules["torch._inductor.output_code"].CompiledFxGraph.__call__ = self._graph_call
            self._graph_call = None

    @property
    def host_reads(self) -> int:
        """Device-to-host reads: scalar reads plus `tolist` calls."""
        return sum(n for op, n in self.ops.items() if op in _READ_OPS) + self.tolist_calls

    @property
    def num_ops(self) -> int:
        """Aten ops dispatched (eager ops, and the extern calls of compiled regions)."""
        return sum(self.ops.values())

    @property
    def launches(self) -> int:
        """`num_ops` plus inductor's kernels: what a GPU host launches (views included, as in
        `num_ops`)."""
        return self.num_ops + self.kernels
