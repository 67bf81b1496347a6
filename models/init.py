"""Mesh-independent initial weights, and the `LocalSlice` a rank holds of a logical tensor.

A parameter's initial values depend only on (seed, its logical name, its logical
shape): never on the blocks or the tensor-parallel slice a rank holds. So a
pipeline stage or a tp shard draws just its own part and still equals the
one-process model's parameter, bit for bit, for the same seed.

The normal draws come in blocks of `ROWS_PER_DRAW` rows, each from its own CPU
generator keyed by a stable hash of (seed, name, block index) (blake2b, not
Python's salted `hash`). A rank holding rows [a, b) draws only the blocks that
overlap them; one holding a column range draws each block whole and keeps its
columns, one block at a time. No full tensor is ever drawn for a slice.

The distribution is HF M2M100's `_init_weights`: N(0, init_std) for linear and
embedding weights, zero biases, LayerNorm weight 1 and bias 0, and the
embedding's padding row zero.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

ROWS_PER_DRAW = 64


@dataclass(frozen=True)
class LocalSlice:
    """What one rank holds of a logical (single-device) tensor of shape `full_shape`:
    `full.narrow(dim, start, length)`, zero-padded along `dim` to `size` entries
    (the padded vocabulary of a tp embedding). `dim` None: the whole tensor.
    `experts` (first, count): a stacked expert tensor (E, ...) cut to experts
    [first, first + count) along dim 0 (expert parallelism), besides any `dim` > 0 split.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    length: int = 0
    size: int = 0
    experts: tuple[int, int] | None = None

    @staticmethod
    def whole(shape: tuple[int, ...] | torch.Size) -> LocalSlice:
        return LocalSlice(tuple(shape))

    def bounds(self, dim: int) -> tuple[int, int]:
        """[lo, hi) read along `dim` of the full tensor."""
        if dim == 0 and self.experts is not None:
            return self.experts[0], self.experts[0] + self.experts[1]
        if self.dim == dim:
            return self.start, self.start + self.length
        return 0, self.full_shape[dim]

    @property
    def read_shape(self) -> tuple[int, ...]:
        """Shape of the part read from the full tensor (before padding)."""
        return tuple(hi - lo for lo, hi in (self.bounds(d) for d in range(len(self.full_shape))))

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the rank's tensor (after padding)."""
        shape = list(self.read_shape)
        if self.dim is not None:
            shape[self.dim] = self.size
        return tuple(shape)

    def pad(self, part: Tensor) -> Tensor:
        """`part` (of `read_shape`) zero-padded to `local_shape`."""
        if self.dim is None or self.size == self.length:
            return part
        out = part.new_zeros(self.local_shape)
        out.narrow(self.dim, 0, self.length).copy_(part)
        return out


def stable_seed(seed: int, name: str, block: int = 0) -> int:
    """A 63-bit generator seed from (seed, name, block), the same in every process and run."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def init_kind(name: str) -> str:
    """'normal', 'zeros' or 'ones' for a parameter of `models.m2m100.M2M100Translation`, by name.

    Raises:
        ValueError: for a name that fits none of the model's parameter kinds.
    """
    *module, leaf = name.split(".")
    is_norm = bool(module) and module[-1].endswith("layer_norm")
    if leaf == "bias":
        return "zeros"
    if leaf == "weight":
        return "ones" if is_norm else "normal"
    raise ValueError(f"no initialisation rule for parameter {name!r}: expected a '.weight' or '.bias'")


def _normal_rows(seed: int, name: str, sl: LocalSlice, std: float) -> Tensor:
    """The slice's part of an N(0, std) matrix drawn in keyed row blocks."""
    rows, cols = sl.full_shape
    r0, r1 = sl.bounds(0)
    c0, c1 = sl.bounds(1)
    out = torch.empty(r1 - r0, c1 - c0, device="cpu")  # (read rows, read cols)
    for block in range(r0 // ROWS_PER_DRAW, -(-r1 // ROWS_PER_DRAW)):
        lo, hi = block * ROWS_PER_DRAW, min(rows, (block + 1) * ROWS_PER_DRAW)
        g = torch.Generator().manual_seed(stable_seed(seed, name, block))
        drawn = torch.empty(hi - lo, cols, device="cpu").normal_(
            0.0, std, generator=g
        )  # (<= ROWS_PER_DRAW, cols)
        a, z = max(lo, r0), min(hi, r1)
        out[a - r0 : z - r0] = drawn[a - lo : z - lo, c0:c1]
    return out


def keyed_init(name: str, sl: LocalSlice, seed: int, std: float, padding_idx: int | None = None) -> Tensor:
    """This rank's part (`sl.local_shape`, float32, CPU) of parameter `name`'s initial value.

    Args:
        name: the logical (single-device) parameter name.
        sl: the part held (`LocalSlice.whole(shape)` on one process).
        seed: the run's seed.
        std: the normal's standard deviation (`ModelConfig.init_std`).
        padding_idx: a row of the full tensor to zero (the embedding's pad token).

    Raises:
        ValueError: for a name with no rule, or a normal-initialised tensor that is not 2-D.
    """
    kind = init_kind(name)
    if kind == "ones":
        return sl.pad(torch.ones(sl.read_shape, device="cpu"))
    if kind == "zeros":
        return torch.zeros(sl.local_shape, device="cpu")
    if len(sl.full_shape) != 2:
        raise ValueError(f"{name}: normal init expects a 2-D weight, got shape {sl.full_shape}")
    part = _normal_rows(seed, name, sl, std)
    r0, r1 = sl.bounds(0)
    if padding_idx is not None and r0 <= padding_idx < r1:
        part[padding_idx - r0].zero_()
    return sl.pad(part)
