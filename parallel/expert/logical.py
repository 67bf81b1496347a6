"""The checkpoint view of stacked expert tensors: one entry per expert, under its transformers name.

A stacked expert parameter (`encoder.layers.3.ffn.experts.fc1_weight`, this rank's experts
[a, a + E_r), each maybe split over tp) and its optimizer state are saved as the per-expert
tensors of the single-device model (`encoder.layers.3.ffn.experts.expert_17.fc1.weight`,
`models.moe.expert_param_name`): expert a + i is `tensor[i]`, a plain tensor, or a `DTensor`
on the tp sub-mesh when tp splits it (dim d of the stack is dim d - 1 of the expert). Since
the names and shapes do not depend on ep, tp or FSDP, DCP reshards a checkpoint across
them (ep 2 -> 4 -> 1); a rank reads and writes only its experts. The entries are views of
the rank's tensors, so DCP loads in place.

Under FSDP an expert tensor is a DTensor sharded on its expert dim over the edp (or dp)
sub-mesh: each rank holds whole experts, `torch.chunk`'s share of the local ones.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from models.moe import expert_param_name


def expert_entries(
    name: str, tensor: Tensor, param: Tensor, tp_mesh: DeviceMesh | None, tp_size: int
) -> dict[str, Tensor]:
    """The per-expert checkpoint entries of stacked expert tensor `tensor` (`param` or its state).

    Args:
        name: the stacked parameter's name.
        tensor: the parameter or an optimizer-state tensor of its shape (a DTensor under FSDP).
        param: the parameter (its marks: `expert_parallel` for the first expert, tp's split dim).
        tp_mesh: the tp sub-mesh (for DTensor entries when tp splits the tensor).
        tp_size: the tp axis size.
    """
    first = int(getattr(param, "expert_parallel", (0, 0))[0])
    local = tensor
    if isinstance(tensor, DTensor):  # FSDP: Shard(0) over a 1-D mesh, whole experts per rank
        mesh = tensor.device_mesh
        per = -(-tensor.shape[0] // mesh.size())
        first += mesh.get_local_rank() * per
        local = tensor._local_tensor  # type: ignore[attr-defined]
    dim = getattr(param, "tp_shard_dim", None) if getattr(param, "tp_sharded", False) else None
    out: dict[str, Tensor] = {}
    for i in range(local.shape[0]):
        piece = local[i]
        if dim is not None and tp_size > 1 and tp_mesh is not None:
            shape = list(piece.shape)
            shape[dim - 1] *= tp_size
            piece = DTensor.from_local(
                piece,
                tp_mesh,
                [Shard(dim - 1)],
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        out[expert_param_name(name, first + i)] = piece
    return out
