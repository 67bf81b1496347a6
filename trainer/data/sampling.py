"""How often each translation direction is drawn: temperature sampling with optional weights.

Legend: d a direction ("en-de"), n_d its training pairs, N = sum n_d, T `sampling_temperature`,
w_d = n_d, or the direction's `sampling_weights` entry when given (weights *replace* the sizes;
the temperature still applies, so T=1 keeps the weights' ratio as given):

    p_d = w_d^(1/T) / sum_e w_e^(1/T)

T=1 without weights is proportional to the data (M2M100 / NLLB use T=5: low-resource directions
are upsampled, T -> inf is uniform; Arivazhagan et al. 2019, "Massively Multilingual NMT in the
Wild", section 4.2).

An epoch stays "as many examples as the data has": it draws N examples, c_d = N p_d of
direction d, rounded by largest remainder so that sum c_d = N. Direction d contributes whole
seeded permutations of its examples while c_d >= n_d (upsampling: every example floor(c_d / n_d)
times or once more), then a seeded subset (downsampling: a different subset each epoch). Counts
are exact per epoch, not multinomial draws, so the realised shares equal p_d up to rounding every
epoch. Everything is a pure function of (sizes, T, weights, seed, epoch): never of the mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from trainer.errors import BadInputError


class SamplingError(BadInputError):
    """A sampling setting that cannot apply to this data; the message names the value."""


@dataclass(frozen=True)
class DirectionSampling:
    """The run's sampling settings: `temperature` T > 0 and optional weights by direction name."""

    temperature: float = 1.0
    weights: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise SamplingError(f"sampling_temperature={self.temperature} must be > 0")
        bad = {k: w for k, w in self.weights.items() if not (math.isfinite(w) and w > 0)}
        if bad:
            raise SamplingError(f"sampling_weights {bad} must all be > 0")

    @property
    def proportional(self) -> bool:
        """True for T=1 without weights: every example once per epoch (no resampling)."""
        return self.temperature == 1.0 and not self.weights

    def signature(self) -> dict[str, object]:
        """What the global batch sequence depends on; empty when proportional (so data states
        saved before sampling existed still load)."""
        if self.proportional:
            return {}
        return {
            "sampling_temperature": self.temperature,
            "sampling_weights": dict(sorted(self.weights.items())),
        }


def direction_probabilities(sizes: Mapping[str, int], sampling: DirectionSampling) -> dict[str, float]:
    """p_d = w_d^(1/T) / sum_e w_e^(1/T) (see the module docstring).

    Args:
        sizes: training pairs n_d per direction name (a direction with 0 pairs gets p_d = 0).
        sampling: the temperature and the optional weights.

    Returns:
        `{direction: p_d}` in the order of `sizes`, summing to 1.

    Raises:
        SamplingError: weights that miss a direction of the data, or weight on a direction without pairs.
    """
    if sampling.weights:
        missing = [d for d in sizes if d not in sampling.weights]
        if missing:
            raise SamplingError(
                f"sampling_weights give no weight for {missing}; they name {sorted(sampling.weights)}"
            )
        empty = [d for d in sizes if sizes[d] == 0]
        if empty:
            raise SamplingError(f"sampling_weights weigh {empty}, which have no training pair left")
    base = {d: float(sampling.weights[d]) if sampling.weights else float(n) for d, n in sizes.items()}
    top = max(base.values())
    if top <= 0:
        raise SamplingError(f"no direction has training pairs: {dict(sizes)}")
    # scale by the largest first: w^(1/T) of 1e9 pairs at T=0.1 would overflow
    powered = {d: (w / top) ** (1.0 / sampling.temperature) if w > 0 else 0.0 for d, w in base.items()}
    total = sum(powered.values())
    return {d: v / total for d, v in powered.items()}


def served_shares(
    directions: Sequence[str], expected: Mapping[str, float], drawn: np.ndarray
) -> dict[str, dict[str, float]]:
    """Per direction: the `expected` share p_d, the `realised` share of the `drawn` examples served
    so far and their count (both samplers report these; the counts travel in the data state)."""
    total = max(1, int(drawn.sum()))
    return {
        name: {"expected": round(expected.get(name, 0.0), 6), "realised": round(int(n) / total, 6),
               "examples": int(n)}
        for name, n in zip(directions, drawn)
    }  # fmt: skip


def window_shares(directions: Sequence[str], drawn: np.ndarray, mark: np.ndarray) -> dict[str, float]:
    """Per direction, its fraction of the examples served since `mark` (an earlier copy of `drawn`):
    the sampled shares of a logging window."""
    window = drawn - mark
    total = max(1, int(window.sum()))
    return {name: round(int(n) / total, 6) for name, n in zip(directions, window)}


def epoch_counts(probabilities: Sequence[float], total: int) -> np.ndarray:
    """c_d = total * p_d rounded by largest remainder (ties to the earlier direction), sum c_d = total."""
    exact = np.asarray(probabilities, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


def draw_epoch(rng: np.random.Generator, groups: Sequence[np.ndarray], counts: np.ndarray) -> np.ndarray:
    """One epoch's example indices: `counts[d]` of group d (whole permutations, then a subset), shuffled.

    Args:
        rng: the epoch's generator (seeded by (seed, epoch)).
        groups: example indices of each direction.
        counts: c_d, draws per direction (from `epoch_counts`).

    Returns:
        The drawn indices in random order, `counts.sum()` of them.
    """
    parts: list[np.ndarray] = []
    for members, c in zip(groups, counts.tolist()):
        full, rest = divmod(c, len(members)) if len(members) else (0, 0)
        parts.extend(members[rng.permutation(len(members))] for _ in range(full))
        if rest:
            parts.append(members[rng.permutation(len(members))[:rest]])
    drawn = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return drawn[rng.permutation(len(drawn))]
