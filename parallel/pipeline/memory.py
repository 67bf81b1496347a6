"""Activation memory per stage: bytes held for backward, charged per (stage, micro-batch).

Bytes are charged to (stage, micro-batch) at its forward and released at its
backward (or at its deferred weight-grad under zero bubble), giving the peak
number of activation bytes in flight on this rank. Two meters share that
interface:

- `AllocatorMeter` (CUDA): the caching allocator's `memory_allocated` before and
  after each forward, a host-side counter read that never waits on the device.
  It is the default on GPUs and costs nothing on the hot path.
- `SavedTensorMeter` (CPU, or on request): counts what autograd keeps, through
  `torch.autograd.graph.saved_tensors_hooks` (parameters excluded, each storage
  once), plus the stage inputs kept for backward and the inputs that
  rematerialised regions keep (reported by `parallel.remat`). CPUs have no
  allocator to ask; on a GPU it is an explicit profiling switch, since a Python
  hook per saved tensor is host work on every micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from parallel import remat


class ActivationMeter(Protocol):
    peak: int

    def record(self, key: Any, inputs: dict[str, Tensor]) -> Any:
        """Context manager: charge what the forward inside it keeps to `key`."""
        ...

    def release(self, key: Any) -> None: ...

    def reset(self) -> None: ...

    def ignore(self, tensors: list[Tensor]) -> None:
        """Never count these storages as activations (the step's working weights)."""
        ...


class _Ledger:
    """Bytes held per key, live total and peak."""

    def __init__(self) -> None:
        self.held: dict[Any, int] = {}
        self.live = 0
        self.peak = 0

    def charge(self, key: Any, nbytes: int) -> None:
        self.held[key] = self.held.get(key, 0) + nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def release(self, key: Any) -> None:
        self.live -= self.held.pop(key, 0)

    def reset(self) -> None:
        self.held.clear()
        self.live = self.peak = 0


class AllocatorMeter(_Ledger):
    """Activation bytes from the CUDA caching allocator: what a forward left allocated."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def ignore(self, tensors: list[Tensor]) -> None:
        """Working weights are allocated before any forward: never in a forward's delta."""

    @contextmanager
    def record(self, key: Any, inputs: dict[str, Tensor]) -> Iterator[None]:
        kept_inputs = sum(t.numel() * t.element_size() for t in inputs.values())
        before = torch.cuda.memory_allocated(self.device)
        try:
            yield
        finally:
            self.charge(key, kept_inputs + torch.cuda.memory_allocated(self.device) - before)


class SavedTensorMeter(_Ledger):
    """Activation bytes as the tensors autograd saves (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from parallel.dp.fsdp import local  # FSDP parameters: the rank's shards

        self.param_ptrs = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.ignored: set[int] = set()

    def _charge_tensor(self, key: Any, seen: set[int], t: Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or ptr in self.ignored or ptr in seen:
            return
        seen.add(ptr)
        self.charge(key, t.untyped_storage().nbytes())

    def ignore(self, tensors: list[Tensor]) -> None:
        """Never count these storages (replaces the previous set: the step's working weights)."""
        self.ignored = {t.untyped_storage().data_ptr() for t in tensors}

    @contextmanager
    def record(self, key: Any, inputs: dict[str, Tensor]) -> Iterator[None]:
        """Charge everything saved for backward inside the block to `key`."""
        seen: set[int] = set()
        for t in inputs.values():
            self._charge_tensor(key, seen, t)

        def pack(t: Tensor) -> Tensor:
            if isinstance(t, Tensor):
                self._charge_tensor(key, seen, t)
            return t

        token = remat.KEPT_INPUT_OBSERVER.set(lambda t: self._charge_tensor(key, seen, t))
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            remat.KEPT_INPUT_OBSERVER.reset(token)


def meter_for(model: nn.Module, device: torch.device, saved_tensors: bool = False) -> ActivationMeter:
    """The allocator meter on CUDA unless `saved_tensors` asks for the hook meter; the hook meter on CPU."""
    if device.type == "cuda" and not saved_tensors:
        return AllocatorMeter(device)
    return SavedTensorMeter(model)
