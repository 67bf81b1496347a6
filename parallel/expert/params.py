"""Which parameters are experts': the mark `parallel.expert.apply` sets, and the split by it.

An expert parameter (the stacked `fc1_weight`, `fc1_bias`, `fc2_weight`, `fc2_bias` of a sparse
layer cut over ep > 1) holds only this rank's experts: its gradient is summed over the
expert-data-parallel group (edp = dp / ep) instead of dp, ZeRO-1 and FSDP shard it over edp,
and the gradient norm sums its square over ep (each expert counted once, as tp shards are
summed over tp). With ep == 1 nothing is marked: the experts are ordinary dp-replicated
parameters.
"""

from __future__ import annotations

from torch import Tensor, nn


def mark_expert_param(param: nn.Parameter) -> None:
    """Mark `param` as holding this rank's experts only (ep > 1)."""
    param.expert_parallel = True  # type: ignore[attr-defined]


def is_expert_param(param: Tensor) -> bool:
    """True if `param` holds this rank's share of the experts (reduced over edp, normed over ep)."""
    return bool(getattr(param, "expert_parallel", False))
