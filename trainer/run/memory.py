"""Peak memory per rank: host RSS (at start-up, after training, at the end) and CUDA allocator peaks,
gathered to every rank by one small all-gather for run_summary.json and the log.

Host peaks are `getrusage(RUSAGE_SELF).ru_maxrss` (KiB on Linux), the process's high-water mark
so far: read right after the model and optimizer are built it is the start-up peak the planner
predicts (`trainer.planner.cost.startup_memory`); read before the final save, the training peak.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
import torch.distributed as dist

FIELDS = (
    "startup_peak_host_bytes",
    "train_peak_host_bytes",
    "peak_host_bytes",
    "peak_cuda_allocated_bytes",
    "peak_cuda_reserved_bytes",
    "teacher_parameter_bytes",  # word-level distillation: this rank's share of the frozen teacher
)


def peak_host_bytes() -> int:
    """This process's peak resident set so far, in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def gather_memory(
    startup_host: int, train_host: int, device: torch.device, teacher_bytes: int = -1
) -> dict[str, list[int] | None]:
    """Every rank's peaks, as per-rank lists (index = global rank; CUDA lists None on CPU; the
    teacher's weights None without one). Collective."""
    cuda = device.type == "cuda"
    mine = [
        startup_host,
        train_host,
        peak_host_bytes(),
        torch.cuda.max_memory_allocated(device) if cuda else -1,
        torch.cuda.max_memory_reserved(device) if cuda else -1,
        teacher_bytes,
    ]
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    table = [r.cpu().tolist() for r in rows]
    out: dict[str, list[int] | None] = {}
    for i, name in enumerate(FIELDS):
        col = [int(r[i]) for r in table]
        out[name] = None if min(col) < 0 else col
    return out


def memory_lines(memory: dict[str, Any]) -> list[str]:
    """The printed summary's lines: max and min over ranks, MiB."""
    lines = []
    for key, label in (
        ("peak_host_bytes", "peak host memory"),
        ("startup_peak_host_bytes", "start-up host peak"),
        ("peak_cuda_allocated_bytes", "peak CUDA allocated"),
        ("peak_cuda_reserved_bytes", "peak CUDA reserved"),
        ("teacher_parameter_bytes", "teacher weights"),
    ):
        col = memory.get(key)
        if col:
            lines.append(f"{label:<20} max {max(col) / 2**20:.0f} MiB   min {min(col) / 2**20:.0f} MiB")
    return lines
