"""The optimisation loop: global batch -> pipeline flushes -> reduce -> clip -> AdamW step.

One optimizer step:

    gb = next(sampler)                        same on every rank (data + seed only)
    flushes = gb.shard(dp_rank)               [gradient_accumulation_steps][num_microbatches]
    pm.train_step(flushes, S / gb.num_tokens) pipeline executor; dp + tied reduce at the last GR
                                              (S = 1, or fp16's loss scale as a device scalar);
                                              dropout keyed by (seed, step, slot): parallel/rng.py
    found = scaler.unscale_(grads)            fp16 only: grads /= S, this rank's found-inf flag
    grad_norm = pm.grads.clip_(max_norm)      over the whole mesh, each parameter once
    guard.check(step, loss_sum, grad_norm,    trainer/run/guard.py: non-finite? preempted? overflow?
                found)                        (all ranks agree)
    scaler.update(agreed overflow)            fp16 only: back off or grow S, on the device
    optimizer.step(); scheduler.step()        unless the guard skips the step (nan_policy=skip, overflow)

The step reads the device once, in the guard's check (a (4,) tensor of flags,
after the step's last backward); the loss sum, the grad norm and the loss scale
stay device tensors, token counts are host numbers from the sampler. `LogWindow`
adds the steps between two log points up and reads the device once per logged
step: the loss logged is the mean token loss over the window's global batches
(the last stage's loss sums, summed over dp, over the window's token count).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from models.m2m100 import layerdrop_skips
from parallel import watchdog
from parallel.distill.teacher import DistillationLoss
from parallel.loss_scale import DynamicLossScale
from parallel.parallelize import ParallelModel
from parallel.pipeline.executor import FlushResult
from parallel.rng import microbatch_keys
from trainer.config.training_args import TrainingArguments
from trainer.run.guard import StepGuard
from trainer.run.moe_load import ExpertLoad


def build_optimizer(
    model: nn.Module, args: TrainingArguments, only: list[nn.Parameter] | None = None
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on biases, layer norms); `only`: ZeRO-1 share.

    Fused (one pass over each parameter, no temporaries) on CUDA and CPU: the same update as
    the per-parameter loop. On CPU, foreach would allocate a full-size temporary per parameter
    and operation (the stacked expert weights of a sparse layer are tens of MB each), ~7x the
    fused step's time on an NLLB-MoE (benchmarks/moe_cpu.md).
    """
    keep = None if only is None else {id(p) for p in only}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad or (keep is not None and id(p) not in keep):
            continue
        (no_decay if p.dim() < 2 or "layer_norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.device.type in ("cuda", "cpu") for p in decay + no_decay)
    return torch.optim.AdamW(
        groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=fused or None,
        foreach=None if fused else True,
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
    loss_sum: Tensor | None  # this replica's sum of token losses (device; last-stage ranks)
    grad_norm: Tensor  # global grad norm before clipping (device scalar)
    lr: float
    num_tokens: int  # target tokens of the global batch (host)
    num_src_tokens: int  # source tokens of the global batch (host)
    flushes: list[FlushResult] = field(default_factory=list)
    skipped: bool = False  # the guard dropped this step's update (non-finite, nan_policy=skip, or overflow)
    preempt_signal: int = 0  # a preemption signal every rank has agreed on (0: none)
    overflow: bool = False  # skipped for an fp16 overflow (the loss itself was finite)
    parts: tuple[Tensor, Tensor] | None = None  # distillation: this replica's (CE, KD) sums (device)


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    global_batch: Any,
    dp_rank: int,
    max_grad_norm: float,
    step: int,
    timed: bool = False,
    guard: StepGuard | None = None,
    seed: int = 0,
    scaler: DynamicLossScale | None = None,
    distill: DistillationLoss | None = None,
) -> StepStats:
    """One optimizer step on `global_batch` (collective over the whole mesh).

    `timed` marks the clock around every pipeline action and starts with a barrier
    (a common start, so per-rank wall times measure the pipeline, not skew).
    `seed` keys LayerDrop's per-step draw (`models.m2m100.layerdrop_skips`; none without LayerDrop)
    and, with the step and each micro-batch's slot, its dropout masks (`parallel.rng`).
    `guard` decides, after the gradients and before the optimizer, whether the update
    is applied (the step's one device read); None applies it unchecked (benchmarks).
    `scaler` (fp16) scales the loss by S, unscales the gradients before clipping and
    backs off or grows S from the overflow every rank agreed on in the guard's check.
    `distill`: the word-level distillation loss `pm` trains on; its CE and KD sums of the step
    go into the stats (device tensors: logged as `label_loss`, `kd_loss`).

    Raises:
        DivergenceError: from the guard (nan_policy=stop, or too many consecutive skips).
        ValueError: a scaler without a guard (the overflow must be agreed before the update).
    """
    if scaler is not None and guard is None:
        raise ValueError("fp16 loss scaling needs the step guard: it agrees on overflows across ranks")
    flushes = global_batch.shard(dp_rank)
    if timed and dist.is_initialized():
        with watchdog.waiting(watchdog.collective(f"barrier that starts step {step}", None)):
            dist.barrier()
    skips = layerdrop_skips(pm.model.config, seed, step)
    keys = microbatch_keys(seed, step, global_batch.slot_ids(dp_rank))
    loss_scale = (1.0 if scaler is None else scaler.scale) / global_batch.num_tokens
    # NLLB-MoE: ParallelModel.train_step keys the routing by (seed, step) and scales the aux loss
    results = pm.train_step(
        flushes, loss_scale=loss_scale, timed=timed, skip_layers=skips, step=step, dropout_keys=keys
    )
    # Unscale before clipping: the norm and the clip threshold are in true-gradient units.
    found = scaler.unscale_(p.grad for p in pm.params()) if scaler is not None else None
    grad_norm = pm.grads.clip_(max_grad_norm)
    sums = [r.loss_sum for r in results if r.loss_sum is not None]
    loss_sum = torch.stack(sums).sum() if sums else None
    parts = distill.take_sums() if distill is not None and loss_sum is not None else None
    apply, signum, overflow = True, 0, False
    if guard is not None:
        verdict = guard.check(step, loss_sum, grad_norm, found)
        apply, signum, overflow = verdict.apply, verdict.signum, verdict.overflow
        if scaler is not None and verdict.agreed_overflow is not None:
            scaler.update(verdict.agreed_overflow)
    if apply:
        optimizer.step()
        pm.after_optimizer_step()
        scheduler.step()
    pm.model.zero_grad(set_to_none=True)  # all grads: a ZeRO-1 optimizer holds only its share
    return StepStats(
        step,
        loss_sum,
        grad_norm,
        scheduler.get_last_lr()[0],
        global_batch.num_tokens,
        global_batch.num_src_tokens,
        results,
        skipped=not apply,
        preempt_signal=signum,
        overflow=overflow,
        parts=parts,
    )


class LogWindow:
    """The steps since the last log point, summed on the device and read once when logged.

    Time is the host's time inside the window's steps plus the wait for the device
    at the read: the host runs ahead of the device by at most its launch queue, and
    the read drains it, so the sum is the window's device-true wall time without
    the evaluation and checkpoint time between steps.

    Args:
        pm: the parallel model (its device and dp group).
        peak_flops: the whole mesh's peak FLOP/s (per-device peak x world size), for MFU;
            None where no peak is known (CPUs).
        scaler: fp16's loss scale, logged as `loss_scale` (read with the rest, no extra sync).
    """

    def __init__(
        self, pm: ParallelModel, peak_flops: float | None = None, scaler: DynamicLossScale | None = None
    ) -> None:
        self.pm, self.peak_flops, self.scaler = pm, peak_flops, scaler
        # NLLB-MoE: expert load, read with the loss (tp ranks > 0 repeat tp rank 0's routing).
        self.moe = (
            ExpertLoad(pm.model, pm.device, counts=pm.mesh.tp_rank == 0) if pm.model.config.is_moe else None
        )
        self.total_tokens, self.total_s, self.total_data_s = 0, 0.0, 0.0
        self._reset()

    def _reset(self) -> None:
        self.steps, self.tokens, self.src_tokens, self.flops, self.seconds = 0, 0, 0, 0.0, 0.0
        self.data_s, self.padded = 0.0, 0  # the wait for each step's batch; its padded positions
        self.loss_tokens = 0  # target tokens of the applied (not skipped) steps: the loss's denominator
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.pm.device)
        self.parts: Tensor | None = None  # distillation: (CE, KD) sums, read with the loss

    def add(
        self, st: StepStats, seconds: float, flops: float = 0.0, data_s: float = 0.0, padded: int = 0
    ) -> None:
        """Count step `st`, which took `seconds` of host time and `flops` model FLOPs, after waiting
        `data_s` for its global batch, whose micro-batches hold `padded` positions (source + target).

        A skipped step counts for throughput (its work was done) but not for the loss, unless
        it was skipped for an fp16 overflow: its loss is finite and was computed as usual.
        """
        self.steps += 1
        self.tokens += st.num_tokens
        self.src_tokens += st.num_src_tokens
        self.flops += flops
        self.seconds += seconds
        self.data_s += data_s
        self.total_data_s += data_s
        self.padded += padded
        if self.moe is not None:
            self.moe.collect()
        if st.skipped and not st.overflow:
            return
        self.loss_tokens += st.num_tokens
        if st.loss_sum is not None:
            self.loss_sum += st.loss_sum
        if st.parts is not None:
            parts = torch.stack(st.parts).float()
            self.parts = parts if self.parts is None else self.parts + parts

    def read(self, st: StepStats) -> dict[str, float | None]:
        """Collective over dp: the window's averages and `st`'s grad norm, in one device read.

        `loss` is left out when every step of the window was skipped; a non-finite
        `grad_norm` (a skipped step) is None (JSON null). fp16: `loss_scale` is S after
        `st`'s update (what the next step scales by).
        """
        start = time.perf_counter()
        # the loss, then distillation's CE and KD sums: one dp all-reduce (every replica's last stage
        # holds them alike, distilling or not: `parts` is None on every rank or on none)
        loss_sum = self.loss_sum[None] if self.parts is None else torch.cat([self.loss_sum[None], self.parts])
        if self.pm.mesh.size("dp") > 1:
            dp_group = self.pm.mesh.group("dp")
            with watchdog.waiting(watchdog.collective("dp all-reduce of the logged loss", dp_group)):
                dist.all_reduce(loss_sum, group=dp_group)
        values = [*loss_sum, st.grad_norm.float()] + ([self.scaler.scale] if self.scaler is not None else [])
        read = torch.stack(values).double()
        if self.moe is not None:  # the expert load rides in the same read
            with watchdog.waiting(watchdog.collective("all-reduce of the expert load", None)):
                read = torch.cat([read, self.moe.values()])
        loss, *rest = read.tolist()  # the one sync
        parts, (grad_norm, *rest) = rest[: len(loss_sum) - 1], rest[len(loss_sum) - 1 :]
        scale, moe = rest[: len(values) - len(loss_sum) - 1], rest[len(values) - len(loss_sum) - 1 :]
        wall = self.seconds + time.perf_counter() - start
        tokens = self.tokens + self.src_tokens
        self.total_tokens += tokens
        self.total_s += wall
        row: dict[str, float | None] = {
            **({"loss": loss / self.loss_tokens} if self.loss_tokens else {}),
            **(
                {"label_loss": parts[0] / self.loss_tokens, "kd_loss": parts[1] / self.loss_tokens}
                if parts and self.loss_tokens
                else {}
            ),
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
            "tokens_per_sec": tokens / wall,
            "step_time_s": wall / max(self.steps, 1),
            "data_time_s": self.data_s / max(self.steps, 1),  # waited for the batch, outside step_time_s
            "num_tokens": float(self.tokens),
            **({"padding_fraction": 1.0 - tokens / self.padded} if self.padded else {}),
            **({"loss_scale": scale[0]} if scale else {}),
            **(self.moe.row(moe) if self.moe is not None else {}),
        }
        if self.peak_flops:
            row["mfu"] = self.flops / wall / self.peak_flops
        self._reset()
        return row


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
    row = torch.zeros(3 * p, dtype=torch.float64, device=pm.device)  # NCCL reduces device tensors only
    r = pm.mesh.pp_rank
    row[r], row[p + r], row[2 * p + r] = busy, wall, float(peak)
    with watchdog.waiting(watchdog.collective("pp all-reduce of the bubble stats", pm.mesh.group("pp"))):
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
