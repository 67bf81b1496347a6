"""The mesh sizes a job asks for: `parallel.mesh.ParallelDims` from the config's parallel section.

Here rather than in `parallel/`, so that `parallel/` never imports the trainer's config.
"""

from __future__ import annotations

import os

from parallel.mesh import ParallelDims
from trainer.config.schema import ParallelArguments


def parallel_dims(
    args: ParallelArguments, world_size: int, local_world_size: int | None = None
) -> ParallelDims:
    """Sizes from the job's `ParallelArguments`.

    Args:
        args: the parallel section of the job config.
        world_size: number of ranks.
        local_world_size: ranks per node; default from the LOCAL_WORLD_SIZE env var.

    Returns:
        Unvalidated dims (call `validate()`).
    """
    if local_world_size is None and "LOCAL_WORLD_SIZE" in os.environ:
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    return ParallelDims(
        pp=args.pipeline_parallel_size,
        dp=args.data_parallel_size,
        tp=args.tensor_parallel_size,
        world_size=world_size,
        local_world_size=local_world_size,
        allow_tp_across_nodes=args.allow_tp_across_nodes,
        ep=args.expert_parallel_size,
    )
