"""The one mapping between our stacked expert parameters and transformers' per-expert names,
and the keyed initial values it implies.

    encoder.layers.3.ffn.experts.fc1_weight (E, F, H)  <->  encoder.layers.3.ffn.experts.expert_<e>.fc1.weight (F, H)

HF import/export (`models.hf`), keyed init (each expert's slice drawn from the generator keyed
by its per-expert name, so a rank holding experts [a, b) draws exactly their values) and
checkpoints use it.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from models.init import LocalSlice, keyed_init

# Stacked parameter of `Experts` -> (projection, leaf) of each expert's `nn.Linear` in transformers.
EXPERT_PARAMS = {
    "fc1_weight": ("fc1", "weight"),
    "fc1_bias": ("fc1", "bias"),
    "fc2_weight": ("fc2", "weight"),
    "fc2_bias": ("fc2", "bias"),
}
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.expert_(?P<e>\d+)\.(?P<proj>fc[12])\.(?P<leaf>weight|bias)$"
)


def expert_param_name(stacked: str, expert: int) -> str:
    """The per-expert (transformers) name of expert `expert`'s slice of a stacked parameter:
    `encoder.layers.3.ffn.experts.fc1_weight`, 17 -> `encoder.layers.3.ffn.experts.expert_17.fc1.weight`.

    Raises:
        ValueError: `stacked` is not a stacked expert parameter.
    """
    prefix, _, leaf = stacked.rpartition(".")
    if leaf not in EXPERT_PARAMS or not prefix.endswith(".experts"):
        raise ValueError(
            f"{stacked!r} is not a stacked expert parameter (expected '...experts.fc1_weight' etc.)"
        )
    proj, kind = EXPERT_PARAMS[leaf]
    return f"{prefix}.expert_{expert}.{proj}.{kind}"


def split_expert_name(name: str) -> tuple[str, int] | None:
    """Inverse of `expert_param_name`: (stacked name, expert index), or None for any other name."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    return f"{m['prefix']}.{m['proj']}_{m['leaf']}", int(m["e"])


def is_expert_param(name: str) -> bool:
    """Whether `name` is a stacked expert parameter of our model."""
    prefix, _, leaf = name.rpartition(".")
    return leaf in EXPERT_PARAMS and prefix.endswith(".experts")


def keyed_expert_init(name: str, part: LocalSlice, seed: int, std: float) -> Tensor:
    """The part (`models.init`'s keyed values) of stacked expert parameter `name`: expert e's
    slice drawn as the transformers-named parameter `expert_param_name(name, e)`, so a rank
    holding experts [a, b) (`part` sliced along dim 0) draws exactly their values, and a slice
    of another dim (tp) is each expert's slice of that dim."""
    lo, hi = part.bounds(0)
    inner = LocalSlice(part.full_shape[1:])
    if part.dim is not None and part.dim > 0:
        inner = LocalSlice(part.full_shape[1:], part.dim - 1, part.start, part.length, part.size)
    values = [keyed_init(expert_param_name(name, e), inner, seed, std) for e in range(lo, hi)]
    return part.pad(torch.stack(values)) if part.dim == 0 else torch.stack(values)
