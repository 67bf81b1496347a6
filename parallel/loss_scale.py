"""fp16 dynamic loss scaling with the scale held on the device.

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is
multiplied by a large factor S before the backward passes, and a too-large S makes
some gradient overflow to inf. Dynamic scaling (Micikevicius et al. 2018, PyTorch's
`GradScaler`, Megatron's `DynamicGradScaler`) searches S per step:

    backward      the last stage backpropagates loss * S / tokens (one device scalar)
    unscale       every local gradient *= 1 / S; found_inf = any non-finite (local)
    agree         found_inf rides in the step guard's one MAX all-reduce over the world,
                  so an overflow on any pp, tp or dp rank skips the step on every rank
    update        overflow: S *= backoff_factor, step skipped;
                  else after `growth_interval` clean steps in a row: S *= growth_factor

Both the unscale and the update are `torch.amp`'s own kernels
(`_amp_foreach_non_finite_check_and_unscale_`, `_amp_update_scale_`), so S and its
growth tracker never leave the device: the step keeps its one host read (the guard's).
GradScaler itself is per process and owns `optimizer.step`; here the agreement,
the skip and the optimizer belong to the step (trainer's run loop), so only its
kernels are used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from parallel.dp.fsdp import local


class DynamicLossScale:
    """The loss scale S and its growth tracker, as device tensors.

    Args:
        device: where S lives (the rank's device).
        init_scale: S at the first step (GradScaler's default 2**16).
        growth_factor: S *= growth_factor after `growth_interval` steps without overflow.
        backoff_factor: S *= backoff_factor on an overflow.
        growth_interval: clean steps in a row before S grows.

    Raises:
        ValueError: a non-positive scale, a growth factor <= 1, a backoff outside (0, 1)
            or an interval < 1.
    """

    def __init__(
        self,
        device: torch.device,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"fp16 initial loss scale {init_scale} must be > 0")
        if not growth_factor > 1:
            raise ValueError(f"fp16 loss-scale growth factor {growth_factor} must be > 1")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"fp16 loss-scale backoff factor {backoff_factor} must be in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"fp16 loss-scale growth interval {growth_interval} must be >= 1")
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    def unscale_(self, grads: Iterable[Tensor | None]) -> Tensor:
        """Multiply every gradient by 1 / S in place; returns this rank's found-inf flag (0. or 1.).

        No host read: the flag stays a device scalar for the step's agreement.
        """
        found = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            if g is not None:
                shard = local(g)  # FSDP: the rank's dp shard of the gradient
                by_dtype.setdefault(shard.dtype, []).append(shard)
        inv = self.scale.double().reciprocal().float()
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        return found

    def update(self, found_inf: Tensor) -> None:
        """Back off or grow S from the agreed flag (a device scalar, > 0 when any rank overflowed)."""
        agreed = (found_inf > 0).float()
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            agreed,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def state_dict(self) -> dict[str, Any]:
        """Host values for the checkpoint (read at save time only, outside the step)."""
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
