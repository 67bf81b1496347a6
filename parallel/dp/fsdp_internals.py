"""Every reach into FSDP2's and DTensor's private parts, in one place, checked against the torch installed.

The public `fully_shard` / `FSDPModule` API (torch >= 2.8, see pyproject.toml) covers
all we use except the few things below; each is private, so a torch release may move
it. `tests/unit/test_fsdp_internals.py` calls `missing()` and names what moved and the
torch version, instead of letting a deferred reduce-scatter silently do nothing.

    post_backward_all(model)   every FSDP unit's post-backward, then the root's final callback:
                               the deferred reduce-scatter at GR (`parallel.dp.fsdp.reduce_scatter`),
                               as `torch.distributed.pipelining.stage` does for its stages
    param_groups(state)        a unit's FSDPParamGroups: `_fsdp_param_groups` (torch >= 2.12),
                               `_fsdp_param_group` (one or None) before
    forget_forwards(model)     drop FSDP's record of the forwards since the last backward (backward
                               prefetching reads it): evaluation's forwards, a different number on
                               each dp replica, must not choose what training's backward prefetches
    local_tensor(t)            a DTensor's local shard, aliasing it (no autograd node, unlike
                               `to_local()`), for in-place gradient work on the shards
    strided_shard(dim, k)      DTensor's `_StridedShard`: dp splitting each of k tp pieces of a dim
    collectives_module()       the module whose `foreach_all_gather` / `foreach_reduce` FSDP calls
                               (tests count them by patching)
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

_GROUP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"
_PLACEMENTS_MODULE = "torch.distributed.tensor.placement_types"


def fsdp_state(model: nn.Module) -> Any:
    """The FSDPState of a `fully_shard`-ed module (`fully_shard.state`, the contract's accessor)."""
    return fully_shard.state(model)  # type: ignore[attr-defined]


def param_groups(state: Any) -> list[Any]:
    """A unit's FSDPParamGroups (none for a unit without parameters)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def all_states(model: nn.Module) -> Iterator[Any]:
    """Every FSDPState under the root `model` (itself included), as its lazy init collected them."""
    yield from fsdp_state(model)._state_ctx.all_states


def post_backward_all(model: nn.Module) -> None:
    """Each unit's post-backward (reduce-scatter of the accumulated unsharded gradients, reshard),
    then the root's end-of-backward callback (waits on the reductions, resets the iteration state)."""
    for state in all_states(model):
        for group in param_groups(state):
            group.post_backward()
    fsdp_state(model)._root_post_backward_final_callback()


def forget_forwards(model: nn.Module) -> None:
    """Clear the post-forward order (and each group's indices into it) that lean FSDP's backward
    prefetch reads: `FSDPParamGroup._backward_prefetch` gathers the unit recorded just before the
    current one. Only a backward clears it; evaluation runs forwards without one (the decoding
    of each dp replica a different number), so the next training backward would prefetch a
    different unit on each rank: all-gathers that do not match, a hang. Before the root's first
    forward (FSDP's lazy init) there is no record yet, and nothing to clear."""
    for state in all_states(model):
        for group in param_groups(state):
            group._post_forward_indices.clear()
    order = getattr(fsdp_state(model)._comm_ctx, "post_forward_order", None)  # set by lazy init
    if order is not None:
        order.clear()


def local_tensor(t: Tensor) -> Tensor:
    """The rank's shard of a DTensor, aliasing its storage (in-place updates reach the DTensor)."""
    return t._local_tensor  # type: ignore[attr-defined,no-any-return]


def strided_shard(dim: int, split_factor: int) -> Any:
    """`_StridedShard(dim, split_factor=k)`: a dim split in k pieces first (tp), each then split (dp)."""
    return importlib.import_module(_PLACEMENTS_MODULE)._StridedShard(dim, split_factor=split_factor)


def collectives_module() -> ModuleType:
    """The module whose `foreach_all_gather` and `foreach_reduce` the param groups call."""
    return importlib.import_module(_GROUP_MODULE)


def missing() -> list[str]:
    """What of the above this torch lacks: one line each, naming the attribute and the version.

    Checked without a process group: class attributes directly, the instance attributes set
    in `FSDPState.__init__` on a bare instance, those set in `FSDPParamGroup.__init__` and
    `FSDPCommContext.lazy_init` in their source, `_StridedShard` by constructing one.
    """
    out: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            out.append(f"torch {torch.__version__}: {what} is gone; update parallel/dp/fsdp_internals.py")

    need(hasattr(fully_shard, "state"), "fully_shard.state (the FSDPState accessor)")
    try:
        state_module = importlib.import_module(_STATE_MODULE)
        group_module = collectives_module()
    except ImportError as e:
        return [f"torch {torch.__version__}: {e}; update parallel/dp/fsdp_internals.py"]
    state = state_module.FSDPState()
    need(
        hasattr(state, "_state_ctx") and hasattr(state._state_ctx, "all_states"),
        "FSDPState._state_ctx.all_states",
    )
    need(
        hasattr(state, "_fsdp_param_groups") or hasattr(state, "_fsdp_param_group"),
        "FSDPState._fsdp_param_groups (or _fsdp_param_group)",
    )
    need(
        callable(getattr(state, "_root_post_backward_final_callback", None)),
        "FSDPState._root_post_backward_final_callback",
    )
    need(
        callable(getattr(group_module.FSDPParamGroup, "post_backward", None)), "FSDPParamGroup.post_backward"
    )
    comm = getattr(state, "_comm_ctx", None)  # its attributes are set in its lazy_init
    comm_source = inspect.getsource(type(comm)) if comm is not None else ""
    need("self.post_forward_order" in comm_source, "FSDPState._comm_ctx.post_forward_order")
    group_init = inspect.getsource(group_module.FSDPParamGroup.__init__)
    need("self._post_forward_indices" in group_init, "FSDPParamGroup._post_forward_indices")
    for name in ("foreach_all_gather", "foreach_reduce"):
        need(callable(getattr(group_module, name, None)), f"{_GROUP_MODULE}.{name}")
    need(
        "_local_tensor" in getattr(DTensor, "__slots__", ()) or hasattr(DTensor, "_local_tensor"),
        "DTensor._local_tensor",
    )
    try:
        strided_shard(0, 2)
    except (AttributeError, TypeError) as e:
        need(False, f"{_PLACEMENTS_MODULE}._StridedShard(dim, split_factor=) ({e})")
    return out
