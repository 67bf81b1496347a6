"""Workers for the hang tests (module-level so spawn can pickle them)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from models.config import ModelConfig
from models.m2m100 import M2M100Translation, Seq2SeqBatch
from parallel.mesh import ParallelDims, build_mesh
from parallel.parallelize import build_parallel_model
from parallel.pipeline.partition import uniform_partition
from parallel.watchdog import RankIdentity, start_watchdog, stop_watchdog
from tests.dist.pipeline_workers import TINY, random_batch


class _Records(logging.Handler):
    """Keeps (monotonic time, message) of every record it sees."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((time.monotonic(), record.getMessage()))


def stalled_flush(rank: int, world: int, stall_s: float, warn_after_s: float) -> dict[str, Any]:
    """pp=2, 1F1B, m=2: one normal step, then the last stage stalls `stall_s` inside the
    forward of micro-batch 1 (a rank stopped mid-flush). Returns, relative to the stalled
    step's start, the time and text of this rank's error and of the watchdog's warnings."""
    records = _Records()
    logging.getLogger("parallel.watchdog").addHandler(records)
    cfg = ModelConfig(**TINY)
    torch.manual_seed(0)
    mesh = build_mesh(ParallelDims(pp=world, dp=1, tp=1, world_size=world))
    start_watchdog(RankIdentity(rank, mesh.dims.shape), warn_after_s, interval_s=0.1)
    model = M2M100Translation(cfg)
    pm = build_parallel_model(model, mesh, uniform_partition(len(model.blocks), world), 2, "1f1b", 1, "none", 0.0)
    batch = random_batch(cfg, 8, seed=1)
    step = [batch.split(2)]
    pm.train_step(step, loss_scale=1.0 / batch.num_tokens())
    if mesh.is_last_stage:
        loss_fn, calls = pm.executor.loss_fn, []

        def stalling_loss(logits: torch.Tensor, batch: Seq2SeqBatch) -> torch.Tensor:
            calls.append(1)
            if len(calls) == 2:  # micro-batch 1
                time.sleep(stall_s)
            return loss_fn(logits, batch)

        pm.executor.loss_fn = stalling_loss
    start = time.monotonic()
    error: BaseException | None = None
    try:
        pm.train_step(step, loss_scale=1.0 / batch.num_tokens())
    except RuntimeError as e:
        error = e
    failed_at = time.monotonic() - start
    stop_watchdog()
    return {
        "error_type": type(error).__name__ if error else None,
        "error": str(error) if error else None,
        "cause": type(error.__cause__).__name__ if error and error.__cause__ else None,
        "error_at": failed_at,
        "warnings": [(t - start, msg) for t, msg in records.seen],
    }
