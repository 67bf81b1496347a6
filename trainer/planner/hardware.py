"""The hardware the planner costs for: the link model (latency + bytes / bandwidth, intra- versus
inter-node) and the device table (peak FLOP/s, memory) for costing a device not at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ConfigError
from trainer.run.flops import PEAK_FLOPS

GIB = 1024**3


@dataclass(frozen=True)
class LinkModel:
    """Transfer times from latency + bytes / bandwidth, inside a node and between nodes."""

    intra_latency_s: float
    intra_bytes_per_s: float
    inter_latency_s: float
    inter_bytes_per_s: float

    def p2p(self, nbytes: float, inter: bool) -> float:
        """Seconds for one message of `nbytes`."""
        if inter:
            return self.inter_latency_s + nbytes / self.inter_bytes_per_s
        return self.intra_latency_s + nbytes / self.intra_bytes_per_s

    def all_reduce(self, nbytes: float, n: int, inter: bool) -> float:
        """Seconds for a ring all-reduce of `nbytes` over n ranks: 2 (n-1) steps of nbytes / n."""
        if n <= 1:
            return 0.0
        latency, bw = (
            (self.inter_latency_s, self.inter_bytes_per_s)
            if inter
            else (self.intra_latency_s, self.intra_bytes_per_s)
        )
        return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bw

    def all_to_all(self, nbytes_sent: float, n: int, inter: bool) -> float:
        """Seconds for an all-to-all over n ranks in which each rank sends `nbytes_sent` to the
        others (pairwise exchanges, n - 1 latencies; every rank's link busy at once)."""
        if n <= 1:
            return 0.0
        if inter:
            return (n - 1) * self.inter_latency_s + nbytes_sent / self.inter_bytes_per_s
        return (n - 1) * self.intra_latency_s + nbytes_sent / self.intra_bytes_per_s


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator kind for FLOP-based costs (`table_kind_costs`).

    efficiency: share of peak FLOP/s the blocks' matmuls reach; block_overhead_s: host time of
    one block's forward + backward on one micro-batch, the floor when kernels are small.
    Both are fitted (least squares on relative error) to the four single-H100 eager runs of
    benchmarks/gpu_h100_runs/README.md run 4: 1.2B 16 x 256 m=1 (0.189 s/step, predicted 0.179),
    418M 32 x 256 m=1 (0.101 / 0.103), 418M 4 x 8 (0.317 / 0.339), 418M 8 x 4 (0.691 / 0.664).
    The other devices reuse the H100's fit with their own peak, memory and links.
    """

    name: str
    peak_flops: float
    memory_gib: float
    hbm_bytes_per_s: float
    efficiency: float
    block_overhead_s: float
    link: LinkModel


def device_spec(name: str, bf16: bool) -> DeviceSpec:
    """The table's entry for `name` (H100, H200, A100), peak by precision.

    Raises:
        ConfigError: an unknown device name, listing the known ones.
    """
    if name not in _DEVICES:
        raise ConfigError(f"unknown device {name!r}; the device table knows {sorted(_DEVICES)}")
    mem, hbm, nvlink, net = _DEVICES[name]
    peak = PEAK_FLOPS[name][0 if bf16 else 1]
    link = LinkModel(8e-6, nvlink, 15e-6, net)
    return DeviceSpec(name, peak, mem, hbm, H100_EFFICIENCY, H100_BLOCK_OVERHEAD_S, link)


# name -> (memory GiB, HBM bytes/s, NVLink all-reduce bus bytes/s, inter-node bytes/s per GPU)
_DEVICES: dict[str, tuple[float, float, float, float]] = {
    "H100": (79.6, 3.35e12, 360e9, 45e9),  # SXM, NVLink 4, one 400 Gb/s NIC per GPU
    "H200": (139.8, 4.8e12, 360e9, 45e9),
    "A100": (79.2, 2.0e12, 230e9, 22e9),  # SXM 80GB, NVLink 3, one 200 Gb/s NIC per GPU
}


H100_EFFICIENCY = 0.62
H100_BLOCK_OVERHEAD_S = 2.9e-3
