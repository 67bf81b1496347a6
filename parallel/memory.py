"""Activation memory per stage: bytes held for backward, measured as it happens.

On CPU there is no allocator to ask, so the meter counts what autograd keeps:
every tensor saved for backward during a forward (through
`torch.autograd.graph.saved_tensors_hooks`, parameters excluded, each storage
once), plus the stage inputs kept for backward and the inputs that
rematerialised regions keep (reported by `parallel.remat`). Bytes are charged to
(stage, micro-batch) at its forward and released at its backward, giving the
peak number of activation bytes in flight on this rank. On CUDA the trainer also
reports `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from parallel import remat


class ActivationMeter:
    def __init__(self, model: nn.Module) -> None:
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.held: dict[Any, int] = {}
        self.live = 0
        self.peak = 0

    def _charge(self, key: Any, seen: set[int], t: Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or ptr in seen:
            return
        seen.add(ptr)
        n = t.untyped_storage().nbytes()
        self.held[key] = self.held.get(key, 0) + n
        self.live += n
        self.peak = max(self.peak, self.live)

    @contextmanager
    def record(self, key: Any, inputs: dict[str, Tensor]) -> Iterator[None]:
        """Charge everything saved for backward inside the block to `key`."""
        seen: set[int] = set()
        for t in inputs.values():
            self._charge(key, seen, t)

        def pack(t: Tensor) -> Tensor:
            if isinstance(t, Tensor):
                self._charge(key, seen, t)
            return t

        token = remat.KEPT_INPUT_OBSERVER.set(lambda t: self._charge(key, seen, t))
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            remat.KEPT_INPUT_OBSERVER.reset(token)

    def release(self, key: Any) -> None:
        self.live -= self.held.pop(key, 0)

    def reset(self) -> None:
        self.held.clear()
        self.live = self.peak = 0
