"""The end of a run: run_summary.json's fields and the printed summary table."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from parallel.compile import CompileCounts
from trainer.checkpoint import dcp as ckpt
from trainer.run.memory import memory_lines
from trainer.run.setup import RunContext
from trainer.run.state import mesh_sizes


def run_summary(
    ctx: RunContext, totals: LoopTotals, before: dict[str, Any] | None, after: dict[str, Any]
) -> dict[str, Any]:
    """The run_summary.json fields (without `predict`, `memory` and `history`)."""
    pp, out, step = ctx.dims.pp, ctx.out, totals.step
    return {
        "mesh": mesh_sizes(ctx.dims),
        "partition": ctx.balance,
        "bubble_fraction_theory": ctx.bubble_theory,
        **({"before": before} if before is not None else {}),
        "after": after,
        "steps": step,
        "skipped_steps": totals.skipped_steps,
        "overflow_steps": totals.overflow_steps,
        "early_stopped": totals.early_stopped,
        "best_metric": ctx.best.best_metric,
        "best_model_checkpoint": ctx.best.best_model_checkpoint,
        "wall_time_s": time.perf_counter() - ctx.t_start,
        "tokens_per_sec": totals.tokens / totals.time_in_steps if totals.time_in_steps else 0.0,
        "data_time_s": totals.data_time,  # waited for batches over the run, besides time_in_steps_s
        "time_in_steps_s": totals.time_in_steps,
        "data_time_share": totals.data_time / (totals.data_time + totals.time_in_steps)
        if totals.time_in_steps
        else 0.0,
        "bubble_fraction": float(np.mean(totals.bubbles)) if totals.bubbles else None,
        "timeline_png": str(out / "timeline.png") if pp > 1 and ctx.cfg.training.plots else None,
        "timeline_trace": str(out / "timeline_trace.json") if pp > 1 else None,
        "data_skipped": data_skipped(ctx),
        "direction_shares": ctx.sampler.shares(),
        "output_dir": str(out),
        "last_checkpoint": str(ckpt.checkpoint_dir(out, step)) if ctx.cfg.training.do_train else None,
    }


def data_skipped(ctx: RunContext) -> dict[str, dict[str, int]]:
    """Pairs skipped (and truncated) per split; a stream's training counts come from its sampler."""
    out = {k: dict(v) for k, v in ctx.data.skipped.items()}
    stream_counts = getattr(ctx.sampler, "skipped", None)  # StreamSampler: counted as the chunks are read
    if isinstance(stream_counts, dict):
        out["train"] = dict(stream_counts)
    return out


def compile_summary(totals: LoopTotals, torch_compile: bool, device: torch.device) -> dict[str, Any]:
    """What dynamo compiled in the training steps, the max over ranks (collective): graphs in the
    session's first step (the warm-up), graphs compiled in later steps (recompiles: after the
    warm-up a run with varying lengths should have none) and graph breaks."""
    first, later = totals.first_step_compiles or CompileCounts(), totals.later_compiles
    mine = [first.graphs, later.graphs, first.graph_breaks + later.graph_breaks]
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    warmup, recompiles, breaks = (int(x) for x in local.tolist())
    return {"torch_compile": torch_compile, "graphs_warmup": warmup, "recompiles_after_warmup": recompiles,
            "graph_breaks": breaks}  # fmt: skip


def print_summary(s: dict[str, Any]) -> None:
    before, after = s.get("before", {}), s.get("after", {})
    lines = [
        "",
        "=" * 64,
        "run summary",
        "=" * 64,
        f"mesh                 pp={s['mesh']['pp']} dp={s['mesh']['dp']} tp={s['mesh']['tp']}"
        + (f" ep={s['mesh']['ep']}" if "ep" in s["mesh"] else "")
        + "  "
        f"partition {s['partition']}",
    ]
    for key in ("eval_loss", "eval_bleu", "eval_chrf", "eval_chrf++", "eval_spbleu"):
        if key in before or key in after:
            b, a = before.get(key), after.get(key)
            lines.append(
                f"{key:<20} before {b if b is None else round(b, 3)!s:>8}   after "
                f"{a if a is None else round(a, 3)!s:>8}"
            )
    lines.append(f"tokens/s             {s['tokens_per_sec']:.0f}")
    if s.get("time_in_steps_s"):
        lines.append(
            f"data wait            {s['data_time_s']:.2f} s ({100 * s['data_time_share']:.1f}% of step time)"
        )
    if s.get("bubble_fraction") is not None:
        lines.append(
            f"bubble               measured {s['bubble_fraction']:.3f}   theory "
            f"{s['bubble_fraction_theory']:.3f}"
        )
        lines.append(f"timeline             {s['timeline_png'] or s['timeline_trace']}")
    lines.extend(memory_lines(s.get("memory") or {}))
    comp = s.get("compile") or {}
    if comp.get("torch_compile"):
        lines.append(
            f"torch_compile        {comp['graphs_warmup']} graphs in the first step, "
            f"{comp['recompiles_after_warmup']} recompiles after it, {comp['graph_breaks']} graph breaks"
        )
    lines.append(f"wall time            {s['wall_time_s']:.1f} s over {s['steps']} steps")
    lines.append(f"output_dir           {s['output_dir']}")
    lines.append(f"last checkpoint      {s['last_checkpoint']}")
    if s.get("best_model_checkpoint"):
        lines.append(
            f"best checkpoint      {s['best_model_checkpoint']} (best_metric {s['best_metric']:.4g})"
        )
    export_from = s.get("best_model_checkpoint") or s["last_checkpoint"]
    export_dir = str(Path(s["output_dir"]) / "hf_export")
    if export_from:
        lines.append(
            f"export               python -m trainer.export --checkpoint {export_from} --output {export_dir}"
        )
    print("\n".join(lines), flush=True)


@dataclass
class LoopTotals:
    """What the training loop hands to the summary."""

    step: int
    tokens: int = 0  # source + target tokens over all steps
    time_in_steps: float = 0.0
    data_time: float = 0.0  # seconds the steps waited for their global batch (next(sampler))
    bubbles: list[float] = field(default_factory=list)  # measured bubble_fraction per logged step (pp > 1)
    skipped_steps: int = 0  # updates the guard dropped (nan_policy=skip)
    overflow_steps: int = 0  # updates the guard dropped for an fp16 gradient overflow
    early_stopped: bool = False  # early_stopping_patience ended training before max_steps
    last_eval: tuple[int, dict[str, Any]] | None = None  # (step, metrics) of the latest evaluation
    last_save: int | None = None  # the step of the latest checkpoint written in the loop
    first_step_compiles: CompileCounts | None = None  # dynamo's work in the session's first step
    later_compiles: CompileCounts = field(default_factory=CompileCounts)  # ... in the steps after it

    def count_compiles(self, step: CompileCounts) -> None:
        """Add what dynamo compiled during one train step (the first one is the warm-up)."""
        if self.first_step_compiles is None:
            self.first_step_compiles = step
        else:
            self.later_compiles = self.later_compiles + step
