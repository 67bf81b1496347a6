"""Which parameters are experts': the mark `parallel.expert.apply` sets, and what follows from it.

An expert parameter cut over ep > 1 (the stacked `fc1_weight`, `fc1_bias`, `fc2_weight`,
`fc2_bias` of a sparse layer) holds only this rank's experts, and carries
`expert_parallel = (first, total)`: its gradient is summed over the expert-data-parallel
group (edp = dp / ep) instead of dp, ZeRO-1 and FSDP shard it over edp, and the gradient
norm sums its square over ep (each expert counted once, as tp shards are summed over tp).
With ep == 1 nothing is marked: the experts are ordinary dp-replicated parameters.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor, nn

from models.init import LocalSlice
from parallel.tp.layers import tp_local_slice


def mark_expert_param(param: nn.Parameter, first: int, total: int) -> None:
    """Mark `param` as holding experts [first, first + its dim 0) of `total` (ep > 1)."""
    param.expert_parallel = (first, total)  # type: ignore[attr-defined]


def is_expert_param(param: Tensor) -> bool:
    """True if `param` holds this rank's share of the experts (reduced over edp, normed over ep)."""
    return getattr(param, "expert_parallel", None) is not None


def expert_local_slice(param: Tensor, tp_size: int, tp_rank: int) -> LocalSlice:
    """What `param` holds of its logical tensor: its tp part (`tp_local_slice`) and, for a cut
    expert parameter, its experts along dim 0 of the stacked (E, ...) tensor."""
    part = tp_local_slice(param, tp_size, tp_rank)
    mark = getattr(param, "expert_parallel", None)
    if mark is None:
        return part
    first, total = mark
    return dataclasses.replace(
        part, full_shape=(total, *part.full_shape[1:]), experts=(first, param.shape[0])
    )
