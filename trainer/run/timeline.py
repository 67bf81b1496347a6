"""The pipeline timeline: one row per pipeline rank, every action as a coloured bar.

Written as `timeline.png` (forward / backward / input-grad / weight-grad / p2p
batches coloured, idle left white, like the GPipe and zero-bubble papers' figures) and as
`timeline_trace.json` in the Chrome trace format (open in chrome://tracing or
Perfetto). Times are each rank's clock relative to its own flush start (device time
from CUDA events on a GPU, `parallel.pipeline.timing`); the trainer starts measured steps
with a barrier so the rows line up.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from parallel.parallelize import ParallelModel
from parallel.pipeline.executor import FlushResult

COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#8172B2", "W": "#CCB974", "GR": "#C44E52", "P2P": "#999999"}
Row = list[tuple[str, float, float]]


def gather_rows(pm: ParallelModel, flushes: list[FlushResult], dst: int) -> list[Row] | None:
    """Collective: each pp rank's (dp 0, tp 0) timeline, gathered on global rank `dst`."""
    mine: Row = []
    offset = 0.0
    for f in flushes:
        mine += [(name, s + offset, e + offset) for name, s, e in f.timeline]
        offset += f.wall_s
    send = (pm.mesh.pp_rank, mine) if pm.mesh.dp_rank == 0 and pm.mesh.tp_rank == 0 else None
    got: list[object] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(send, got, dst=dst)
    if got is None:
        return None
    rows: list[Row] = [[] for _ in range(pm.mesh.size("pp"))]
    for item in got:
        if item is not None:
            rows[int(item[0])] = list(item[1])  # type: ignore[index]
    return rows


def render_png(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.2))
    for rank, row in enumerate(rows):
        for name, start, end in row:
            kind = "GR" if name == "GR" else "P2P" if name[0] in "SR" else name[0]  # S/R: a comm batch
            ax.broken_barh(
                [(start * 1e3, max(end - start, 1e-6) * 1e3)],
                (rank - 0.4, 0.8),
                facecolors=COLORS.get(kind, "#999999"),
                edgecolor="white",
                linewidth=0.3,
            )
            if kind in "FBIW" and (end - start) * 1e3 > 0.02 * max(r[-1][2] for r in rows if r) * 1e3:
                ax.text(
                    (start + end) / 2 * 1e3,
                    rank,
                    name[1:].split(".")[-1],
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
    ax.set_yticks(range(len(rows)), [f"stage rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(
        handles,
        ["forward", "backward", "input grad", "weight grad", "grad reduce", "p2p batch (incl. wait)"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35),
        fontsize=7,
        ncol=6,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def chrome_trace(rows: list[Row]) -> dict[str, object]:
    events = [
        {
            "name": name,
            "ph": "X",
            "pid": 0,
            "tid": rank,
            "ts": start * 1e6,
            "dur": (end - start) * 1e6,
            "cat": name[0],
        }
        for rank, row in enumerate(rows)
        for name, start, end in row
    ]
    meta = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"pp rank {r}"}}
        for r in range(len(rows))
    ]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def write_timeline(
    pm: ParallelModel, flushes: list[FlushResult], out: Path, is_logger: bool, step: int, draw: bool = True
) -> str | None:
    """Collective. Writes timeline_trace.json and (`draw`: the `plots` option) timeline.png on the
    logging rank; returns the PNG's path there, if drawn."""
    dst = _logger_rank(pm)
    rows = gather_rows(pm, flushes, dst)
    if not is_logger or rows is None:
        return None
    (out / "timeline_trace.json").write_text(json.dumps(chrome_trace(rows)))
    if not draw:
        return None
    png = out / "timeline.png"
    plan = pm.plan
    render_png(rows, png, f"step {step}: {plan.schedule_name}, p={plan.p}, m={plan.m}, v={plan.v}")
    return str(png)


def _logger_rank(pm: ParallelModel) -> int:
    from parallel.mesh import coords_to_rank

    return coords_to_rank((pm.plan.last_stage_rank, 0, 0), pm.mesh.dims.shape)
