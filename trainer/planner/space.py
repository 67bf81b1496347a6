"""The planner's search space: schedules, remat policies and partitions (as lists to extend),
the meshes `ParallelDims` accepts for a world, and the cuts of the config's global batch
(micro-batch x m x g x dp = const).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from models.config import ModelConfig
from parallel.errors import ParallelConfigError
from parallel.mesh import ParallelDims
from trainer.config.checks import SCHEDULE_CHOICES, SHARDING_CHOICES
from trainer.config.dims import parallel_dims
from trainer.config.schema import JobConfig
from trainer.errors import ConfigError

# The search space, as lists to extend: (schedule, virtual stages per rank); remat; partition.
SCHEDULE_SPACE: list[tuple[str, int]] = [
    ("1f1b", 1),
    ("gpipe", 1),
    ("interleaved_1f1b", 2),
    ("interleaved_1f1b", 4),
    ("zero_bubble", 1),
    ("zbv", 2),  # used only where the trainer and parallel.pipeline.schedule.build_schedule accept it
]
REMAT_SPACE = ("none", "selective", "full", "stage")
PARTITION_SPACE = ("time", "uniform", "parameters", "memory")
SHARDING_SPACE = ("none", "zero1", "fsdp")  # data_parallel_sharding, where dp > 1
MAX_ACCUMULATION = 8  # the most accumulation flushes (g) a batch cut may use


@dataclass(frozen=True)
class Budget:
    """The global batch every layout must keep: sentences, or token cap x slots in token mode."""

    total: int
    token_mode: bool
    longest: int  # token mode: the smallest cap that holds the longest example


def schedule_space() -> list[tuple[str, int]]:
    """`SCHEDULE_SPACE` less the schedules this checkout's trainer or schedule builder lacks."""
    from parallel.pipeline.schedule import build_schedule

    out = []
    for name, v in SCHEDULE_SPACE:
        if name not in SCHEDULE_CHOICES:
            continue
        try:
            build_schedule(name, 2, 4, v)
        except ParallelConfigError:
            continue
        out.append((name, v))
    return out


def sharding_space(dp: int, only: list[str] | None = None) -> list[str]:
    """The `data_parallel_sharding` modes to try on a mesh with `dp` replicas ("none" alone if dp = 1),
    less those this checkout's trainer lacks and those `only` leaves out."""
    if dp == 1:
        return ["none"]
    return [s for s in SHARDING_SPACE if s in SHARDING_CHOICES and (not only or s in only)]


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def meshes(
    world: int, gpus_per_node: int, arch: ModelConfig, teacher: ModelConfig | None = None
) -> tuple[list[ParallelDims], list[tuple[str, str]]]:
    """Every (pp, tp, dp) with pp * tp * dp = world that `ParallelDims.validate` accepts, and for a
    sparse model (or a sparse distillation teacher) every expert-parallel size ep dividing dp and
    the experts; tp must divide a teacher too (`trainer.run.distill.check_mesh`).

    Returns:
        (valid dims, [(mesh, reason)] for the rejected ones).
    """
    from parallel.mesh import check_ep_divides_model, check_tp_divides_model
    from trainer.run.distill import check_mesh

    sparse = any(m is not None and m.is_moe and m.sparse_layers() for m in (arch, teacher))
    valid, rejected = [], []
    for pp in divisors(world):
        for tp in divisors(world // pp):
            dp = world // (pp * tp)
            for ep in divisors(dp) if sparse else [1]:
                dims = ParallelDims(pp, dp, tp, world, local_world_size=gpus_per_node, ep=ep)
                try:
                    check_mesh(dims, arch, teacher)
                    if teacher is not None:
                        check_tp_divides_model(teacher, tp)
                        if teacher.is_moe:
                            check_ep_divides_model(teacher, ep, dp)
                    valid.append(dims)
                except ParallelConfigError as e:
                    rejected.append((f"pp={pp} tp={tp} dp={dp}" + (f" ep={ep}" if ep > 1 else ""), str(e)))
    return valid, rejected


def batch_budget(cfg: JobConfig, world: int) -> Budget:
    """The config's global batch: per_device_train_batch_size (or the token cap) x m x g x dp.

    Raises:
        ConfigError: the config's own mesh does not fit `world`, so its global batch is undefined.
    """
    p, t = cfg.parallel, cfg.training
    try:
        dp0 = parallel_dims(p, world, local_world_size=world).validate().dp
    except ParallelConfigError as e:
        raise ConfigError(f"the config's mesh does not fit --world_size {world}: {e}") from None
    slots = p.num_microbatches * t.gradient_accumulation_steps * dp0
    cap = cfg.data.max_tokens_per_microbatch
    if cap:
        return Budget(cap * slots, True, max(cfg.data.max_source_length, cfg.data.max_target_length))
    return Budget(t.per_device_train_batch_size * slots, False, 1)


def batch_cuts(budget: Budget, dp: int, max_m: int) -> Iterator[tuple[int, int, int]]:
    """(m, g, micro-batch) with micro-batch x m x g x dp = the budget (token caps >= the longest example)."""
    if budget.total % dp:
        return
    per_replica = budget.total // dp
    for m in divisors(per_replica):
        if m > max_m:
            break
        for g in divisors(per_replica // m):
            mb = per_replica // (m * g)
            if g <= MAX_ACCUMULATION and mb >= budget.longest:
                yield m, g, mb
