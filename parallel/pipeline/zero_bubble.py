"""Split backward for zero-bubble schedules: input grads now (I), weight grads later (W).

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", sec 2) split each backward into
B (activation gradient, on the critical path to the previous stage) and W (weight
gradient, needed only by the optimizer), and fill the pipeline's cooldown bubble
with W. As in their Megatron implementation, linear layers (where nearly all
weight-gradient FLOPs are) compute dX = dY W during I and queue the closure
dW = dY^T X for W; layer norms and embeddings keep computing their small
weight grads during I.

`enable_deferred_wgrad(model, store)` swaps the forward of every linear-like module
(anything with a 2-D `weight` used as Y = X W^T + b: `nn.Linear` and the
tensor-parallel linears, which expose `linear_input_transform` /
`linear_output_transform` around their local matmul) for one built on
`_DeferrableLinear`. Outside `store.deferring(key)` it behaves exactly like
`F.linear` (grads immediate), so B actions and other schedules are unaffected.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class WeightGradStore:
    """Deferred weight-gradient closures, keyed by (stage, micro-batch)."""

    def __init__(self) -> None:
        self.key: Any = None
        self.queues: dict[Any, list[Callable[[], None]]] = defaultdict(list)

    @contextmanager
    def deferring(self, key: Any) -> Iterator[None]:
        self.key = key
        try:
            yield
        finally:
            self.key = None

    def put(self, fn: Callable[[], None]) -> None:
        self.queues[self.key].append(fn)

    def flush(self, key: Any) -> None:
        for fn in self.queues.pop(key, []):
            fn()

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())


def _accumulate(param: Tensor, grad: Tensor) -> None:
    if param.grad_fn is not None:  # a bf16 working copy (parallel.mixed_precision): through its cast
        torch.autograd.backward(param, grad.to(param.dtype))
        return
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _DeferrableLinear(torch.autograd.Function):
    """Y = X W^T + b whose dW, db may be queued instead of computed (see module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightGradStore) -> Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        xc = x if dtype is None else x.to(dtype)
        wc = weight if dtype is None else weight.to(dtype)
        bc = bias if (bias is None or dtype is None) else bias.to(dtype)
        ctx.save_for_backward(xc, wc)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        g = grad_out.to(w.dtype)
        grad_x = (g @ w).to(grad_out.dtype) if ctx.needs_input_grad[0] else None  # (.., out) @ (out, in)
        weight, bias = ctx.weight, ctx.bias

        def weight_grads() -> tuple[Tensor, Tensor | None]:
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            return g2.t() @ x2, (g2.sum(0) if bias is not None else None)  # (out, in), (out,)

        if ctx.store.key is not None:

            def later() -> None:
                gw, gb = weight_grads()
                _accumulate(weight, gw)
                if gb is not None:
                    _accumulate(bias, gb)

            ctx.store.put(later)
            return grad_x, None, None, None
        gw, gb = weight_grads()
        return grad_x, gw.to(weight.dtype), (gb.to(bias.dtype) if gb is not None else None), None


def deferrable_linear(x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightGradStore) -> Tensor:
    return _DeferrableLinear.apply(x, weight, bias, store)


def enable_deferred_wgrad(model: nn.Module, store: WeightGradStore) -> int:
    """Route every linear-like module of `model` through `_DeferrableLinear`; returns the count."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = _patched_linear(module, store)  # type: ignore[method-assign,assignment]
            count += 1
        elif hasattr(module, "linear_input_transform") and hasattr(module, "linear_output_transform"):
            module.forward = _patched_parallel_linear(module, store)  # type: ignore[method-assign]
            count += 1
    return count


def _patched_linear(module: nn.Linear, store: WeightGradStore) -> Callable[[Tensor], Tensor]:
    def forward(x: Tensor) -> Tensor:
        return deferrable_linear(x, module.weight, module.bias, store)

    return forward


def _patched_parallel_linear(module: Any, store: WeightGradStore) -> Callable[[Tensor], Tensor]:
    # Tensor-parallel linears: comm before (copy/gather) and after (reduce) the local matmul.
    def forward(x: Tensor) -> Tensor:
        bias_inside = getattr(module, "bias_in_matmul", True)
        y = deferrable_linear(
            module.linear_input_transform(x), module.weight, module.bias if bias_inside else None, store
        )
        return module.linear_output_transform(y)

    return forward
