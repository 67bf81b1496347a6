"""Choose the pipeline partition: by rule, by parameters, or by measured time / memory.

Measuring runs on rank 0 only and the result is broadcast, so every rank cuts the
model the same way (timings differ between processes; a split that differed
would hang the pipeline).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.m2m100 import M2M100Translation, block_specs
from parallel.mesh import ParallelMesh
from parallel.partition import format_partition, resolve_partition
from parallel.profile import profile_blocks
from trainer.config.schema import JobConfig


def choose_partition(
    cfg: JobConfig, mc: ModelConfig, mesh: ParallelMesh, sampler, device: torch.device
) -> tuple[list[int], str]:  # type: ignore[no-untyped-def]
    """Block counts per stage (p * v stages) and a printable table of the split."""
    n_stages = mesh.size("pp") * cfg.parallel.virtual_stages
    names = [b.name for b in block_specs(mc)]
    method = cfg.parallel.partition_balance() or cfg.parallel.partition_method
    payload: list[object] = [None]
    if dist.get_rank() == 0:
        times = mems = None
        counts = None
        if method in ("time", "memory", "parameters") or n_stages > 1:
            # A sample micro-batch from a copy of the sampler (the real one's position is untouched).
            # Profiling builds the whole model on rank 0: it must fit one device.
            sample = copy.deepcopy(sampler)
            batch = next(sample).shard(0)[0][0].to(device)
            torch.manual_seed(cfg.training.seed)
            times, mems, counts = profile_blocks(M2M100Translation(mc).to(device), batch)
        balance = resolve_partition(
            method, names, n_stages, param_counts=counts, time_costs=times, mem_costs=mems
        )
        payload = [(balance, format_partition(balance, names, times, mems))]
    dist.broadcast_object_list(payload, src=0)
    chosen: tuple[list[int], str] = payload[0]  # type: ignore[assignment]
    return list(chosen[0]), str(chosen[1])
