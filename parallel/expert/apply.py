"""Expert parallelism applied from outside: each rank keeps its experts, tp splits their FFN dim,
and the all-to-all dispatcher replaces the local one.

    with torch.device("meta"): model           every sparse layer holds E experts (shapes only)
      -> keep_only / apply_tensor_parallel      (parallel.parallelize; tp leaves sparse FFNs alone)
      -> apply_expert_parallel                  experts [r E/ep, (r+1) E/ep) of ep rank r, F split over tp
      -> materialize                            only those experts' tp slices get memory and values

Legend: P = ep size, r = ep rank, E experts, E_l = E / P, p = tp size, F FFN dim, H d_model.

Expert tensor parallelism (Megatron's "expert tensor parallelism"): each expert's FFN is split
like a dense one, fc1 column-parallel (F rows), fc2 row-parallel (F columns):

    buffer (E_l, C, H) --f--> act(x W1_r^T + b1_r) W2_r^T --g--> + b2     (E_l, C, H)
    or grouped rows (M, H), the same with `GroupedLinear` per projection  (M, H)

with f = identity forward / all-reduce backward and g = all-reduce forward / identity backward
(`parallel.tp.comm`); b2 is replicated and added once, after the sum. The activation dropout
of the split hidden draws from the rank's tp fork (`parallel.tp.rng`), the output's from the
shared stream (every tp rank holds the same rows), as for a dense FFN. The router stays
replicated: every tp rank routes the same tokens and sends them over its own ep group.
Under sequence parallelism the sparse FFN sees the whole routing group (the micro-batch):
`parallel.tp.apply.enable_sequence_parallel` all-gathers its input along T and splits its
output back, so routing, capacity and the aux loss are those of the unsplit batch.

Parameters keep their names (`...ffn.experts.fc1_weight`); a cut one carries
`expert_parallel = (first, total)` (`parallel.expert.params`), from which the rank's
`LocalSlice` (`expert_local_slice`) and its checkpoint entries under the per-expert
transformers names follow.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from models.attention import dropout_at
from models.m2m100 import M2M100Translation
from models.moe import Experts, batched_linear
from models.moe.experts import GroupedLinear, GroupedRows
from parallel.expert.dispatch import A2AStats, AllToAllDispatcher, ReplicatedDispatcher
from parallel.expert.params import mark_expert_param
from parallel.tp.comm import copy_to_tp, reduce_from_tp
from parallel.tp.layers import _mark

# Stacked expert parameter -> the dim tp splits (F), or None (replicated over tp).
TP_DIM = {"fc1_weight": 1, "fc1_bias": 1, "fc2_weight": 2, "fc2_bias": None}


@dataclass
class ExpertParallelInfo:
    """What the rest of a run needs after `apply_expert_parallel`.

    Attributes:
        ep_size, ep_rank: the ep group's size and this rank's place in it.
        first, count: this rank's experts [first, first + count) of every sparse layer.
        stats: the all-to-all byte counter shared by the model's dispatchers.
    """

    ep_size: int
    ep_rank: int
    first: int
    count: int
    stats: A2AStats = field(default_factory=A2AStats)


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """(first, count) of the experts ep rank `ep_rank` holds: contiguous, E / ep each.

    Raises:
        ValueError: ep does not divide the experts.
    """
    if num_experts % ep_size:
        raise ValueError(f"expert_parallel_size={ep_size} does not divide num_experts({num_experts})")
    count = num_experts // ep_size
    return ep_rank * count, count


def apply_expert_parallel(
    model: M2M100Translation, ep_group: ProcessGroup | None, tp_group: ProcessGroup | None = None
) -> ExpertParallelInfo | None:
    """Cut every sparse layer's experts to this rank's (ep) and split their FFN dim (tp), in place.

    Works on meta models (shapes only: `parallel.materialize` fills them later) and on models
    with weights (the rank's slices are copied). Makes no collective.

    Args:
        model: the rank's model (after `keep_only`, and `apply_tensor_parallel` when tp > 1).
        ep_group: the ep group (None or one rank: every expert stays).
        tp_group: the tp group (None or one rank: no split).

    Returns:
        The info, or None when the model has no sparse layer on this rank.
    """
    ffns = model.sparse_ffns()
    if not ffns:
        return None
    ep, rank = (dist.get_world_size(ep_group), dist.get_rank(ep_group)) if ep_group is not None else (1, 0)
    tp, tp_rank = (dist.get_world_size(tp_group), dist.get_rank(tp_group)) if tp_group is not None else (1, 0)
    total = next(iter(ffns.values())).experts.num_experts
    first, count = expert_range(total, ep, rank)
    info = ExpertParallelInfo(ep, rank, first, count)
    for ffn in ffns.values():
        experts: Experts = ffn.experts
        if ep > 1:
            _cut_experts(experts, first, count)
            ffn.dispatcher = AllToAllDispatcher(ep_group, info.stats)  # type: ignore[arg-type]
        if tp > 1:
            assert tp_group is not None
            ffn.experts = TensorParallelExperts.from_experts(experts, tp_group, tp, tp_rank)
    return info


@contextmanager
def replicated_tokens(model: M2M100Translation) -> Iterator[None]:
    """Within: the sparse layers take their tokens as the same on every rank of the ep group
    (`ReplicatedDispatcher`: local experts, then a sum over ep), for evaluation and decoding,
    where the ep peers run the same batch. A no-op without expert parallelism."""
    swapped = [
        (ffn, ffn.dispatcher)
        for ffn in model.sparse_ffns().values()
        if isinstance(ffn.dispatcher, AllToAllDispatcher)
    ]
    try:
        for ffn, a2a in swapped:
            ffn.dispatcher = ReplicatedDispatcher(a2a.group)
        yield
    finally:
        for ffn, a2a in swapped:
            ffn.dispatcher = a2a


def _cut_experts(experts: Experts, first: int, count: int) -> None:
    """Keep experts [first, first + count) of every stacked parameter (meta: shapes only)."""
    for name in TP_DIM:
        param: nn.Parameter = getattr(experts, name)
        total = param.shape[0]
        kept = _take(param, 0, first, count)
        setattr(experts, name, kept)
        mark_expert_param(kept, first, total)
    experts.expert_offset = first


def _take(param: nn.Parameter, dim: int, start: int, length: int) -> nn.Parameter:
    """A new parameter holding `param.narrow(dim, start, length)` (copied; meta stays meta)."""
    part = param.detach().narrow(dim, start, length)
    kept = nn.Parameter(part if part.is_meta else part.clone(), requires_grad=param.requires_grad)
    for key, value in vars(param).items():  # marks set before (tp, ep)
        setattr(kept, key, value)
    return kept


class TensorParallelExperts(Experts):
    """This rank's experts with their FFN dim split over tp (see the module docstring).

    Holds fc1_weight (E_l, F/p, H), fc1_bias (E_l, F/p), fc2_weight (E_l, H, F/p) and the
    replicated fc2_bias (E_l, H); names, `num_experts` and `expert_offset` as `Experts`.
    """

    group: ProcessGroup

    @classmethod
    def from_experts(
        cls, experts: Experts, group: ProcessGroup, tp: int, tp_rank: int
    ) -> TensorParallelExperts:
        """The tp shard of `experts` (its parameters sliced along F; meta stays meta)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.num_experts, out.expert_offset = experts.num_experts, experts.expert_offset
        out.act, out.activation_dropout, out.dropout = (
            experts.act,
            experts.activation_dropout,
            experts.dropout,
        )
        out.activation_dropout_rng = experts.activation_dropout_rng  # per tp rank (parallel.tp.rng)
        out.group = group
        out.train(experts.training)
        for name, dim in TP_DIM.items():
            param: nn.Parameter = getattr(experts, name)
            if dim is None:
                setattr(out, name, param)
                _mark(param, False)
                continue
            size = param.shape[dim]
            if size % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the experts' FFN dim ({size})")
            shard = _take(param, dim, tp_rank * (size // tp), size // tp)
            setattr(out, name, _mark(shard, True, dim))
        return out

    supports_groups = True  # `models.moe.experts.takes_groups`: the grouped layout too

    def forward(self, x: Tensor, groups: GroupedRows | None = None) -> Tensor:
        """The buffer (E_l, C, H) -> (E_l, C, H), or grouped rows (M, H) -> (M, H): every tp rank
        holds the same rows (the same tokens, routed alike), so the partial sums add up."""
        x = copy_to_tp(x, self.group)
        zero = torch.zeros_like(self.fc2_bias)
        if groups is None:
            h = self.act(batched_linear(x, self.fc1_weight, self.fc1_bias))  # (E_l, C, F/p)
        else:
            h = self.act(GroupedLinear.apply(x, self.fc1_weight, self.fc1_bias, groups))  # (M, F/p)
        h = dropout_at(self.activation_dropout_rng, h, self.activation_dropout, self.training)
        if groups is None:
            partial = batched_linear(h, self.fc2_weight, zero)  # (E_l, C, H)
            bias = self.fc2_bias.to(partial.dtype)[:, None, :]
        else:
            partial = GroupedLinear.apply(h, self.fc2_weight, zero, groups)  # (M, H), 0 past the groups
            bias = torch.where(groups.valid[:, None], self.fc2_bias.to(partial.dtype)[groups.expert], 0.0)
        y = reduce_from_tp(partial, self.group) + bias
        return F.dropout(y, self.dropout, self.training)
