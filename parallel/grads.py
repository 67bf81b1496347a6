"""A step's gradient work, in one place: what happens to `.grad` between the last
backward of an optimizer step and the optimizer.

    last flush of the step
      B (final backward of each stage)   arm(stage): dp buckets launch as their grads finish
      GR                                 reduce(): dp sum (waits for the buckets), then the
                                         sequence-parallel sum over tp, then the tied
                                         embedding's sum across the stages holding it
    after the flush
      clip_(max_norm)                    global norm over the whole mesh, grads scaled

Under FSDP (`parallel.dp.fsdp`) the dp reduce is FSDP's reduce-scatter (at GR, or in
autograd's hooks in lean mode), and every gradient is the rank's dp shard: the
sums over tp and pp run on the local shards (same dp coordinate, same piece), and
the norm sums the shards' squares over dp too.

Expert parallelism (`parallel.expert`, ep > 1): the experts' parameters (marked
`expert_parallel`) hold different experts on the ranks of an ep group, so their dp
buckets run over the expert-data-parallel group (edp = dp / ep) instead of dp, and the
norm sums their squares over ep (over the whole dp under FSDP, which shards them over
edp): each expert counted once, as tp shards are summed over tp.

Order matters in one place only: overlapped dp buckets are copied back into
`.grad` when they finish, so the sums over other axes (tp for sequence-parallel
norms, pp for the tied embedding) follow the dp reduce. Sums over different axes
commute, so the result equals summing in any order.

Nothing here reads a device value on the host: the norm is a device scalar, the
clip coefficient `min(1, max_norm / (norm + 1e-6))` a device scalar applied with
one foreach multiply (as `torch.nn.utils.clip_grad_norm_` does), and the norm is
read by the trainer only when it logs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from parallel import watchdog
from parallel.dp.fsdp import FullySharded, local, local_grads
from parallel.dp.reduce import GradReducer
from parallel.expert.params import is_expert_param
from parallel.mesh import Axis, ParallelMesh
from parallel.tp.comm import _size
from parallel.tp.layers import is_sequence_parallel_param, is_tp_sharded


class StepGradients:
    """Gradient reduction and clipping for this rank's stages.

    Args:
        model: this rank's (pruned, tp-sharded) model.
        stage_params: parameters of each of this rank's stages, in stage order.
        mesh: the (pp, dp, tp) mesh.
        tied_ranks: pp ranks whose stages use the tied embedding (first, tgt_embed, last).
        sequence_parallel: whether replicated norms see sequence-split activations.
        overlap_dp: launch dp buckets during the final backward (off for zero bubble,
            whose deferred weight grads bypass the hooks).
    """

    def __init__(
        self,
        model: nn.Module,
        stage_params: Sequence[Sequence[nn.Parameter]],
        mesh: ParallelMesh,
        tied_ranks: Sequence[int],
        sequence_parallel: bool = False,
        overlap_dp: bool = True,
        fsdp: FullySharded | None = None,
    ) -> None:
        self.mesh, self.sequence_parallel, self.fsdp = mesh, sequence_parallel, fsdp
        # The fp32 parameters, held here: inside a bf16 step the modules hold working copies.
        self.params = list(model.parameters())
        self.shared: nn.Parameter | None = getattr(getattr(model, "shared", None), "weight", None)
        exclude = [self.shared] if self.shared is not None else []
        by_stage = [[p for p in ps if not is_expert_param(p)] for ps in stage_params] if fsdp is None else []
        self.reducer = GradReducer(
            by_stage,
            mesh.group("dp") if mesh.size("dp") > 1 and fsdp is None else None,
            overlap=overlap_dp,
            exclude=exclude,
        )
        # ep > 1: the experts' grads, summed over the replicas holding the same experts (edp)
        expert_stages = [[p for p in ps if is_expert_param(p)] for ps in stage_params] if fsdp is None else []
        self.expert_reducer = GradReducer(
            expert_stages,
            mesh.group("edp") if mesh.size("edp") > 1 and any(expert_stages) else None,
            overlap=overlap_dp,
        )
        self.tied_ranks = list(tied_ranks)
        self.tied_group = mesh.pp_subgroup(self.tied_ranks) if len(self.tied_ranks) > 1 else None

    def arm(self, stage_slot: int) -> None:
        """The next backward is the step's last one of this rank's `stage_slot`-th stage."""
        self.reducer.arm(stage_slot)
        self.expert_reducer.arm(stage_slot)

    def reduce(self) -> None:
        """At GR of the step's last flush: dp, then sequence-parallel tp, then tied-embedding sums."""
        if self.fsdp is not None:
            self.fsdp.reduce_scatter()
        self.reducer.all_reduce()
        self.expert_reducer.all_reduce()
        if self.sequence_parallel:
            sync_sequence_parallel_grads(self.params, self.mesh.group("tp"))
        if self.tied_group is not None and self.shared is not None:
            if self.shared.grad is None:
                self.shared.grad = torch.zeros_like(self.shared)
            with watchdog.waiting(watchdog.collective("tied-embedding all-reduce", self.tied_group)):
                dist.all_reduce(local(self.shared.grad), group=self.tied_group)

    def norm(self) -> Tensor:
        """Global L2 norm of the gradients (a device scalar; collective over tp and pp).

        Each logical parameter counts once: tp shards are summed over tp, tp-replicated
        parameters counted once, the tied embedding only on the first pp rank holding
        it; dp replicas hold equal gradients after the reduce, so no dp sum (FSDP: each
        holds a shard, and the shards' squares are summed over dp). Expert shards (ep > 1)
        are summed over ep (FSDP: over dp, i.e. ep x their edp shards).
        """
        tied_copy = self.shared is not None and self.mesh.pp_rank != self.tied_ranks[0]
        params = [p for p in self.params if not (tied_copy and p is self.shared)]
        experts = [p for p in params if is_expert_param(p)]
        params = [p for p in params if not is_expert_param(p)]
        tp_group = self.mesh.group("tp") if self.mesh.size("tp") > 1 else None
        total = grad_sq_over_tp(params, tp_group)
        if self.fsdp is not None and self.mesh.size("dp") > 1:
            _sum_over(total, self.mesh.group("dp"), "dp all-reduce of the gradient norm")
        if experts:  # ep > 1; the same call on every rank of the group (every stage has the same layers)
            sq = grad_sq_over_tp(experts, tp_group)
            axis: Axis = "dp" if self.fsdp is not None else "ep"
            _sum_over(sq, self.mesh.group(axis), f"{axis} all-reduce of the experts' gradient norm")
            total = total + sq
        if self.mesh.size("pp") > 1:
            pp_group = self.mesh.group("pp")
            with watchdog.waiting(watchdog.collective("pp all-reduce of the gradient norm", pp_group)):
                dist.all_reduce(total, group=pp_group)
        return total.sqrt()

    def clip_(self, max_norm: float) -> Tensor:
        """Scale every gradient so the global norm is at most `max_norm` (if > 0); returns the norm."""
        norm = self.norm()
        if max_norm > 0:
            grads = local_grads(self.params)
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef)
        return norm


def _sum_over(total: Tensor, group: ProcessGroup, what: str) -> None:
    with watchdog.waiting(watchdog.collective(what, group)):
        dist.all_reduce(total, group=group)


def grad_sq_over_tp(params: Sequence[nn.Parameter], tp_group: ProcessGroup | None) -> Tensor:
    """Squared L2 norm of the parameters' gradients over the tp group (an fp32 device scalar,
    identical on all tp ranks): tp shards summed over ranks, replicated parameters counted once."""
    sharded = local_grads([p for p in params if is_tp_sharded(p)])
    replicated = local_grads([p for p in params if not is_tp_sharded(p)])
    device = next(iter(params)).device if params else torch.device("cpu")
    sq_sharded = _sum_sq(sharded, device)
    if tp_group is not None and _size(tp_group) > 1:
        with watchdog.waiting(watchdog.collective("tp all-reduce of the gradient norm", tp_group)):
            dist.all_reduce(sq_sharded, group=tp_group)
    return sq_sharded + _sum_sq(replicated, device)


def _sum_sq(grads: list[Tensor], device: torch.device) -> Tensor:
    """Sum of squares of all elements of `grads`, in fp32 (foreach: a few kernels for all)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads)
    return torch.stack([n.float() for n in norms]).square().sum()


def sync_sequence_parallel_grads(params: Sequence[nn.Parameter], tp_group: ProcessGroup) -> None:
    """All-reduce over tp the gradients of replicated parameters used on sequence-split activations.

    Call once per optimizer step, after all backward passes and before the dp
    reduction / grad-norm; a no-op without sequence parallelism. One flat
    all-reduce, in the order of `params` (the model's, identical on all tp ranks).
    """
    grads = local_grads([p for p in params if is_sequence_parallel_param(p)])
    if not grads or _size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with watchdog.waiting(watchdog.collective("tp all-reduce of sequence-parallel gradients", tp_group)):
        dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
