"""Choose the pipeline partition: by rule, by parameters, or by measured time / memory.

What each method costs at start-up (no rank ever builds the whole model):

    explicit list / uniform    nothing is built or measured
    parameters                 counted on a model built on the meta device (shapes only)
    time / memory              one block of each kind measured on rank 0
                               (`parallel.pipeline.profile.profile_blocks_by_kind`), the result
                               broadcast, so every rank cuts the model the same way
                               (timings differ between processes; a split that differed
                               would hang the pipeline)

The blocks are measured as the run executes them (`run_setting`): on a tp rank's shard
(without a process group), in the run's precision (autocast, and the step's working weights
when it has several micro-batches), under its remat policy and MoE routing (dropless or the
capacity factor), on a sample micro-batch of the run's size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.m2m100 import M2M100Translation, block_specs
from parallel.mesh import ParallelMesh
from parallel.pipeline.partition import format_partition, resolve_partition
from parallel.pipeline.profile import (
    RunSetting,
    expert_params_per_block,
    param_counts_per_block,
    profile_blocks_by_kind,
)
from trainer.config.schema import JobConfig
from trainer.run.rank0 import on_rank0


def choose_partition(
    cfg: JobConfig,
    mc: ModelConfig,
    mesh: ParallelMesh,
    sampler: Any,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> tuple[list[int], str]:
    """Block counts per stage (p * v stages) and a printable table of the split.

    `dtype`: the run's working dtype (`trainer.run.setup.working_dtype`), None for fp32.
    """
    n_stages = mesh.size("pp") * cfg.parallel.virtual_stages
    names = [b.name for b in block_specs(mc)]
    method = cfg.parallel.partition_balance() or cfg.parallel.partition_method
    if not isinstance(method, str) or method in ("uniform", "parameters"):
        counts = _param_counts(mc, mesh.size("ep")) if method == "parameters" else None
        balance = resolve_partition(method, names, n_stages, param_counts=counts)
        return balance, format_partition(balance, names)

    def measure() -> tuple[list[int], str]:
        # A sample micro-batch of the first global batch (the sampler's position is untouched).
        batch = sampler.peek().shard(0)[0][0].to(device)
        run = run_setting(cfg, mesh.size("tp"), dtype)
        times, mems, counts = profile_blocks_by_kind(
            mc, batch, device, seed=cfg.training.seed, run=run, ep=mesh.size("ep")
        )
        balance = resolve_partition(
            method, names, n_stages, param_counts=counts, time_costs=times, mem_costs=mems
        )
        return balance, format_partition(balance, names, times, mems)

    # A failure measuring (out of memory, bad input) raises on every rank, not only on rank 0.
    payload: list[object] = [on_rank0(dist.get_rank(), "measure the blocks for balancing", measure)]
    dist.broadcast_object_list(payload, src=0)
    chosen: tuple[list[int], str] = payload[0]  # type: ignore[assignment]
    return list(chosen[0]), str(chosen[1])


def run_setting(cfg: JobConfig, tp: int, dtype: torch.dtype | None) -> RunSetting:
    """How this run executes a block (`RunSetting`): what balancing must measure."""
    p = cfg.parallel
    several = p.num_microbatches * cfg.training.gradient_accumulation_steps > 1  # ParallelModel.train_step
    m = cfg.model
    return RunSetting(
        tp, p.sequence_parallel and tp > 1, dtype, several, p.activation_checkpointing,
        moe_dropless=m.moe_dropless, moe_capacity_factor=m.moe_capacity_factor,
    )  # fmt: skip


def _param_counts(mc: ModelConfig, ep: int = 1) -> list[int]:
    """Parameters per block on one rank (the tied table counted once; a sparse layer's experts
    E / ep), from a meta model: no memory, no init."""
    with torch.device("meta"):
        model = M2M100Translation(mc)
    experts = expert_params_per_block(model)
    return [n - (x - x // ep) for n, x in zip(param_counts_per_block(model), experts)]


def param_partition(mc: ModelConfig, n_stages: int, ep: int = 1) -> list[int]:
    """Block counts per stage balancing this rank's parameters (a frozen distillation teacher's:
    its memory is its weights)."""
    names = [b.name for b in block_specs(mc)]
    return resolve_partition("parameters", names, n_stages, param_counts=_param_counts(mc, ep))
