"""Expert load of an NLLB-MoE run: per sparse layer, summed on the device over a logging window
and read with the window's one device read.

After each step `collect` moves what the sparse layers recorded (`SparseFFN.pop_stats`: per
micro-batch, assignments per expert before capacity, assignments dropped, the aux loss and the
micro-batch's target tokens) into one device vector laid out over all sparse layers of the
config, (E + 3) entries per layer:

    [assignments per expert (E) | dropped | sum_mb aux * tokens_mb | sum_mb tokens_mb]

Nothing is read from the device there. At a logged step `values()` is summed over every rank
(layers of other pipeline stages are zeros here; tp ranks other than 0 contribute zeros, their
routing repeats rank 0's; dp replicas add their tokens) and read with the loss; `row()` turns
it into the `moe_*` keys of `metrics.jsonl` (per layer `moe_enc3_*` / `moe_dec1_*`):

    tokens_max, tokens_mean   assignments per expert per step: the busiest expert, the average
    dropped                   fraction of the assignments dropped by capacity
    aux_loss                  the load-balancing loss, token-weighted over the window

plus `moe_aux_loss` (its mean over the layers: the value weighted into the loss) and
`moe_dropped` (over all layers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from models.m2m100 import M2M100Translation


def short_name(layer: str) -> str:
    """`encoder.layers.3` -> `enc3`, `decoder.layers.1` -> `dec1`."""
    side, _, index = layer.split(".")
    return f"{side[:3]}{index}"


class ExpertLoad:
    """The window's expert load on this rank (see the module docstring).

    Args:
        model: this rank's (pruned) model; its config names every sparse layer.
        device: where the sums live.
        counts: False on tp ranks other than 0 (their routing repeats rank 0's).
    """

    def __init__(self, model: M2M100Translation, device: torch.device, counts: bool = True) -> None:
        c = model.config
        self.model, self.experts, self.counts = model, c.num_experts, counts
        self.layers = c.sparse_layers()
        self.width = self.experts + 3
        self.sums = torch.zeros(len(self.layers) * self.width, dtype=torch.float64, device=device)
        self.steps = 0

    def collect(self) -> None:
        """Add what the sparse layers recorded since the last call (no device read)."""
        self.steps += 1
        for name, ffn in self.model.sparse_ffns().items():
            stats = ffn.pop_stats()
            if not stats or not self.counts:
                continue
            i = self.layers.index(name) * self.width
            part = self.sums[i : i + self.width]
            part[: self.experts] += torch.stack([s.tokens_per_expert for s in stats]).sum(0)
            part[self.experts] += torch.stack([s.dropped for s in stats]).sum()
            part[self.experts + 1] += torch.stack([s.aux_loss * s.num_tokens for s in stats]).sum()
            part[self.experts + 2] += sum(s.num_tokens for s in stats)

    def values(self) -> Tensor:
        """The window's sums over every rank (a collective over the world when there are several)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.sums)
        return self.sums

    def row(self, values: list[float]) -> dict[str, float]:
        """The `moe_*` keys from `values()` read back; resets the window."""
        row: dict[str, float] = {}
        aux_layers: list[float] = []
        dropped = assigned = 0.0
        steps = max(self.steps, 1)
        for k, name in enumerate(self.layers):
            part = values[k * self.width : (k + 1) * self.width]
            per_expert, drop, aux_w, tokens = part[: self.experts], *part[self.experts :]
            total = sum(per_expert)
            key = f"moe_{short_name(name)}"
            row[f"{key}_tokens_max"] = max(per_expert) / steps
            row[f"{key}_tokens_mean"] = total / self.experts / steps
            row[f"{key}_dropped"] = drop / total if total else 0.0
            row[f"{key}_aux_loss"] = aux_w / tokens if tokens else 0.0
            aux_layers.append(row[f"{key}_aux_loss"])
            dropped, assigned = dropped + drop, assigned + total
        if self.layers:
            row["moe_aux_loss"] = sum(aux_layers) / len(aux_layers)
            row["moe_dropped"] = dropped / assigned if assigned else 0.0
        self.sums.zero_()
        self.steps = 0
        return row


def load_line(row: dict[str, float]) -> str:
    """A one-line summary of a row's expert load for the log: per layer, max/mean load and drops."""
    parts = []
    for key in row:
        if key.endswith("_tokens_max"):
            layer = key[len("moe_") : -len("_tokens_max")]
            mean = row[f"moe_{layer}_tokens_mean"]
            ratio = row[key] / mean if mean else 0.0
            parts.append(f"{layer} max/mean {ratio:.2f} dropped {100 * row[f'moe_{layer}_dropped']:.1f}%")
    return f"expert load: aux {row.get('moe_aux_loss', 0.0):.4f}; " + ", ".join(parts)
