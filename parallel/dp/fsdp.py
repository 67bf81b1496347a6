"""Fully sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`) over the dp axis.

Parameters, gradients and optimizer state are sharded over dp (ZeRO stage 3,
Rajbhandari et al. 2020): each encoder/decoder layer and the rank's model root
(embedding, final norms) are one `fully_shard` unit on the 1-D dp sub-mesh, so a
layer's parameters are all-gathered just before it runs and its gradients
reduce-scattered after. Tensor parallelism composes underneath: our tp layers hold
plain local shards, so FSDP shards each tp shard over dp. As in torchtitan, the
pipeline decides when FSDP communicates:

    pp == 1, full backward     memory-lean: reshard after forward, reduce-scatter after
    ("lean")                   each backward (autograd's hooks); one layer's unsharded
                               parameters and gradients alive at a time, besides the
                               root's (the tied embedding, used first and last: FSDP keeps
                               the root gathered from its forward to its backward)
    pp > 1 or split backward   gather once per flush (no reshard between micro-batches),
    ("deferred")               accumulate unsharded gradients, reduce-scatter once per step
                               at GR (`reduce_scatter`), after the last W of zero bubble
                               wrote its deferred weight grads: as torch's own
                               `pipelining.stage.PipelineStage.perform_reduce_grad`

Gradients are dp *sums* (divide factor 1): the trainer scales the loss by
1 / tokens(global batch), as for `parallel.dp.reduce`. `bf16` maps to FSDP's
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: bf16 gathered working
weights, fp32 gradient accumulation, reduction and master shards (layer norms: fp32
units of their own, as `parallel.mixed_precision` keeps them). Generation reads
weights outside `forward` and runs inside `gathered`.

After `fully_shard` every parameter is a `DTensor` sharded over dp; `local` gives
the rank's shard (a plain tensor aliasing it) for the gradient work in
`parallel.grads`, and `logical` the DCP view of a tensor on the (dp, tp) sub-mesh.
Only public FSDP2 API here; what is private lives in `parallel.dp.fsdp_internals`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from parallel.dp.fsdp_internals import forget_forwards, local_tensor, post_backward_all, strided_shard
from parallel.expert.params import is_expert_param
from parallel.mesh import Axis, ParallelMesh
from parallel.mixed_precision import keeps_fp32

# Marks parallel.tp puts on parameters; fully_shard makes new Parameters, which must keep them.
_MARKS = ("tp_sharded", "tp_shard_dim", "tp_logical_size", "sequence_parallel", "expert_parallel")
# Methods that run blocks without `forward` (pipeline stages call run_blocks).
_FORWARD_METHODS = ("run_blocks",)


def _shard_dim(param: nn.Parameter) -> Shard:
    """dp shards dim 0, or dim 1 where tp already splits dim 0 (column-parallel weights, the
    vocab-parallel embedding), so each rank's piece is a plain (dp, tp) block of the logical
    tensor that DCP can address (`logical`). 1-D column-parallel biases stay on dim 0."""
    if getattr(param, "tp_sharded", False) and param.tp_shard_dim == 0 and param.dim() > 1:  # type: ignore[attr-defined]
        return Shard(1)
    return Shard(0)


def _units(
    model: nn.Module, param_dtype: torch.dtype | None
) -> list[tuple[nn.Module, MixedPrecisionPolicy, Axis]]:
    """The FSDP units, inner first, with the axis each shards over: each encoder/decoder layer
    this rank holds, then the root (what the layers leave: embedding, final norms), over dp.
    Experts cut over ep > 1 (`parallel.expert`) are units of their own over edp: the replicas
    holding the same experts. Under bf16, layer norms (and an fp32 MoE router) are units of
    their own that keep fp32 weights (`parallel.mixed_precision.keeps_fp32`: the residual stream
    stays fp32, and CPU layer norm rejects bf16 weights on fp32 input). Inputs are not cast: autocast,
    on under bf16, casts activations at each matmul (and FSDP cannot rebuild a batch dataclass)."""
    fp32 = MixedPrecisionPolicy(cast_forward_inputs=False)
    low = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    norms = [m for m in model.modules() if keeps_fp32(m)] if param_dtype is not None else []
    stacks = [getattr(model, name, None) for name in ("encoder", "decoder")]
    layers = [layer for stack in stacks if stack is not None for layer in stack.layers.values()]
    experts = [
        m
        for m in model.modules()
        if any(is_expert_param(p) for p in m.parameters(recurse=False))  # the stacked experts
    ]
    policy = low if param_dtype is not None else fp32
    return (
        [(m, fp32, "dp") for m in norms]
        + [(m, policy, "edp") for m in experts]
        + [(m, policy, "dp") for m in [*layers, model]]
    )


class FullySharded:
    """This rank's model under FSDP2 on the dp axis, and the step's FSDP controls.

    Args:
        model: the rank's pruned (and tp-sharded) model, on its device.
        mesh: the (pp, dp, tp) mesh.
        param_dtype: working dtype of the gathered weights (bf16), or None for fp32.
        deferred: gather once per flush and reduce-scatter once per step at GR (pp > 1 or
            split backward); False: memory-lean FSDP (reshard after forward, reduce per backward).
    """

    def __init__(
        self, model: nn.Module, mesh: ParallelMesh, param_dtype: torch.dtype | None, deferred: bool
    ) -> None:
        self.model, self.mesh, self.deferred = model, mesh, deferred
        self._gathered = False  # inside `gathered()`
        marks = {
            name: {k: getattr(p, k) for k in _MARKS if hasattr(p, k)} for name, p in model.named_parameters()
        }
        for module, policy, axis in _units(model, param_dtype):  # children before the units holding them
            fully_shard(
                module,
                mesh=mesh[axis],
                reshard_after_forward=not deferred,
                mp_policy=policy,
                shard_placement_fn=_shard_dim,
            )
        for method in _FORWARD_METHODS:
            register_fsdp_forward_method(model, method)
        for name, p in model.named_parameters():
            for k, v in marks[name].items():
                setattr(p, k, v)
        self.units: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in self.units:
            # dp sum, not mean (see the module docstring), as a plain SUM (gloo has no PREMUL_SUM)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        self.root: FSDPModule = model  # type: ignore[assignment]

    def begin_step(self) -> None:
        """Before a step's first backward: in deferred mode, only accumulate until GR."""
        self.reshard()
        if self.deferred:
            self.root.set_is_last_backward(False)
            self.root.set_reshard_after_backward(False)
            self.root.set_requires_gradient_sync(False)

    def reduce_scatter(self) -> None:
        """At GR of the step's last flush (deferred mode): every unit's post-backward, now
        with gradient sync: the accumulated unsharded gradients (the deferred weight grads
        of zero bubble included, written by W before GR) are reduce-scattered into the
        sharded `.grad`, and the parameters resharded. Lean mode: autograd's hooks did it."""
        if not self.deferred:
            return
        self.root.set_is_last_backward(True)
        self.root.set_reshard_after_backward(True)
        self.root.set_requires_gradient_sync(True)
        post_backward_all(self.model)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Within: every unit's full parameters, kept between forwards (generation reads the
        layers' weights outside `forward`: per-stage KV caches). Collective over dp: every dp
        replica enters it the same number of times. Re-entrant: a nested entry gathers nothing,
        so a caller whose replicas make different numbers of generate calls (the last batches of
        a split evaluation set) wraps them all in one entry."""
        if self._gathered:
            yield
            return
        self._gathered = True
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield
        finally:
            self._gathered = False
            for unit in self.units:
                unit.set_reshard_after_forward(not self.deferred and unit is not self.root, recurse=False)
            self.reshard()
            forget_forwards(self.model)  # the forwards run within, e.g. decoding's, had no backward

    def reshard(self) -> None:
        """Free every gathered parameter (after evaluation in deferred mode, whose forward
        keeps them: the optimizer then updates the shards, and stale gathered copies must go)."""
        for unit in self.units:
            unit.reshard()


def is_fsdp_param(p: Tensor) -> bool:
    return isinstance(p, DTensor)


def local(t: Tensor) -> Tensor:
    """The rank's shard of an FSDP tensor (aliasing it), or `t` itself."""
    return local_tensor(t) if isinstance(t, DTensor) else t


def dp_chunk(param: Tensor, value: Tensor) -> Tensor:
    """This rank's piece of `value` (a tensor of the FSDP parameter `param`'s unsharded shape) as
    FSDP shards it: `torch.chunk` over the dp sub-mesh along the sharded dim, empty for a rank
    past the last chunk (FSDP2's `_chunk_with_empty`), so `local(param).copy_(dp_chunk(param, v))`
    writes what `fully_shard` would have kept of a parameter holding `v`.

    Raises:
        ValueError: `param` is not sharded over one mesh dim, or the piece does not fit its shard.
    """
    assert isinstance(param, DTensor)
    (place,) = param.placements
    if not isinstance(place, Shard):
        raise ValueError(f"dp_chunk expects a dp-sharded parameter, got placements {param.placements}")
    mesh = param.device_mesh
    chunks = torch.chunk(value, mesh.size(), dim=place.dim)
    rank = mesh.get_local_rank()
    piece = chunks[rank] if rank < len(chunks) else value.narrow(place.dim, 0, 0)
    if piece.shape != local(param).shape:
        raise ValueError(
            f"dp chunk {tuple(piece.shape)} does not fit the local shard {tuple(local(param).shape)}"
        )
    return piece


def local_grads(params: Iterator[nn.Parameter] | list[nn.Parameter]) -> list[Tensor]:
    """The rank's shards of the parameters' gradients (those that have one)."""
    return [local(p.grad) for p in params if p.grad is not None]


def logical(
    tensor: Tensor, param: Tensor, mesh: ParallelMesh, tp_size: int, vocab: tuple[int, int] | None = None
) -> Tensor:
    """`tensor` (an FSDP parameter or its optimizer state: a DTensor sharded over dp) as DCP
    should see it: the single-device tensor, as a DTensor on the (dp, tp) sub-mesh whose local
    piece aliases the rank's shard (so DCP loads in place).

    Args:
        tensor: a DTensor on the dp sub-mesh (FSDP's layout of `param`).
        param: the parameter (its tp marks say whether, and on which dim, tp splits it).
        mesh: the (pp, dp, tp) mesh.
        tp_size: the tp axis size.
        vocab: for the vocab-parallel embedding, (real rows of this tp rank's shard, vocabulary
            size): the padding rows are cut off, as in the non-fsdp layout; else None.
    """
    if not isinstance(tensor, DTensor) or tp_size == 1 or not getattr(param, "tp_sharded", False):
        return tensor  # dp-sharded only: FSDP's DTensor is already the logical tensor
    tp_dim = int(param.tp_shard_dim)  # type: ignore[attr-defined]
    dp_dim = tensor.placements[0].dim  # type: ignore[attr-defined]
    piece = local(tensor)
    shape = list(tensor.shape)  # the tp shard's shape
    shape[tp_dim] *= tp_size
    if vocab is not None:  # rows of the padded vocabulary: keep the real ones (dp splits dim 1)
        piece, shape[0] = piece.narrow(0, 0, vocab[0]), vocab[1]
    # dp splits a different dim: a plain block; the same dim (1-D column-parallel biases):
    # dp splits each tp piece, DTensor's strided sharding (as FSDP2 over DTensor tp).
    dp_place = Shard(dp_dim) if dp_dim != tp_dim else strided_shard(dp_dim, tp_size)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        piece,
        mesh["dp", "tp"],
        [dp_place, Shard(tp_dim)],
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )
