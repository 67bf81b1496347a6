"""The optimisation loop: global batch -> pipeline flushes -> reduce -> clip -> AdamW step.

One optimizer step:

    gb = next(sampler)                        same on every rank (data + seed only)
    flushes = gb.shard(dp_rank)               [gradient_accumulation_steps][num_microbatches]
    pm.train_step(flushes, 1 / gb.num_tokens) pipeline executor; dp + tied reduce at the last GR
    grad_norm = pm.clip_grad_norm_(max_norm)  over the whole mesh, each parameter once
    optimizer.step(); scheduler.step()

The loss reported is the mean token loss of the global batch: the last stage's
loss sums, summed over dp, over the global token count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.executor import FlushResult
from parallel.parallelize import ParallelModel
from trainer.config import TrainingArguments


def build_optimizer(
    model: nn.Module, args: TrainingArguments, only: list[nn.Parameter] | None = None
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases, layer norms); `only`: ZeRO-1 share."""
    keep = None if only is None else {id(p) for p in only}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad or (keep is not None and id(p) not in keep):
            continue
        (no_decay if p.dim() < 2 or "layer_norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        foreach=False,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments) -> Any:
    from transformers import get_scheduler

    return get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=args.warmup_steps,
        num_training_steps=args.max_steps,
    )


@dataclass
class StepStats:
    step: int
    loss: float  # mean token loss of the global batch (valid on last-stage ranks)
    grad_norm: float
    lr: float
    num_tokens: int
    num_src_tokens: int
    step_time_s: float
    flushes: list[FlushResult] = field(default_factory=list)


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    global_batch: Any,
    dp_rank: int,
    max_grad_norm: float,
    step: int,
    sync_for_timing: bool = False,
) -> StepStats:
    """One optimizer step on `global_batch` (collective over the whole mesh)."""
    flushes = global_batch.shard(dp_rank)
    src_tokens = sum(int(mb.attention_mask.sum()) for f in flushes for mb in f)
    if sync_for_timing and dist.is_initialized():
        dist.barrier()  # a common start, so per-rank wall times measure the pipeline, not skew
    t0 = time.perf_counter()
    results = pm.train_step(flushes, loss_scale=1.0 / global_batch.num_tokens)
    grad_norm = pm.clip_grad_norm_(max_grad_norm)
    optimizer.step()
    pm.after_optimizer_step()
    scheduler.step()
    pm.model.zero_grad(set_to_none=True)  # all grads: a ZeRO-1 optimizer holds only its share
    step_time = time.perf_counter() - t0
    loss_sum = sum(r.loss_sum for r in results)
    loss_sum, src_tokens = _sum_over_dp(pm, loss_sum, src_tokens)
    return StepStats(
        step,
        loss_sum / global_batch.num_tokens,
        grad_norm,
        scheduler.get_last_lr()[0],
        global_batch.num_tokens,
        src_tokens,
        step_time,
        results,
    )


def _sum_over_dp(pm: ParallelModel, loss_sum: float, src_tokens: int) -> tuple[float, int]:
    if pm.mesh.size("dp") == 1:
        return loss_sum, src_tokens
    t = torch.tensor([loss_sum, float(src_tokens)], dtype=torch.float64)
    dist.all_reduce(t, group=pm.mesh.group("dp"))
    return float(t[0]), int(t[1])


def bubble_stats(pm: ParallelModel, flushes: list[FlushResult]) -> dict[str, float]:
    """Measured bubble over the pp axis: 1 - sum(busy) / (p * makespan), plus per-stage compute time.

    The makespan ends at the schedule's GR action: the dp / tied-embedding reduce that
    follows is not pipeline idle time and is reported as `grad_reduce_s` instead.
    Collective over the pp group (call on every rank at the same step).
    """
    p = pm.mesh.size("pp")
    busy = sum(f.busy_s for f in flushes)
    wall = sum(f.pipeline_s for f in flushes)
    reduce_s = sum(f.wall_s - f.pipeline_s for f in flushes)
    peak = max((f.peak_activation_bytes for f in flushes), default=0)
    if p == 1:
        return {
            "bubble_fraction": max(0.0, 1 - busy / wall) if wall else 0.0,
            "grad_reduce_s": reduce_s,
            "stage_compute_s_0": busy,
            "peak_activation_bytes_stage_0": float(peak),
        }
    row = torch.zeros(3 * p, dtype=torch.float64)
    r = pm.mesh.pp_rank
    row[r], row[p + r], row[2 * p + r] = busy, wall, float(peak)
    dist.all_reduce(row, group=pm.mesh.group("pp"))
    busy_all, wall_all, peak_all = row[:p].tolist(), row[p : 2 * p].tolist(), row[2 * p :].tolist()
    makespan = max(wall_all)
    out = {
        "bubble_fraction": 1 - sum(busy_all) / (p * makespan) if makespan > 0 else 0.0,
        "grad_reduce_s": reduce_s,
    }
    for i in range(p):
        out[f"stage_compute_s_{i}"] = busy_all[i]
        out[f"peak_activation_bytes_stage_{i}"] = peak_all[i]
    return out


def bubble_theory(schedule: str, p: int, m: int, v: int) -> float:
    """(p-1)/(m+p-1) for GPipe and 1F1B (GPipe paper), /v for interleaved (Narayanan et al. 2021)."""
    if p == 1:
        return 0.0
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)
