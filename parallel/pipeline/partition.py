"""Cutting the model's ordered blocks into pipeline stages (pure, no torch).

This module owns the *balance*: how many consecutive blocks each stage gets
(torchgpipe's ``balance`` list). ``partition_blocks`` minimises the most
expensive stage for any per-block cost (parameters, measured time or memory);
``resolve_partition`` turns the ``partition_method`` config field into a balance.
Measuring the costs is the caller's job.
"""

from __future__ import annotations

from collections.abc import Sequence

# k: stages (n_stages), b: blocks (n_blocks); stage i holds blocks
# [sum(balance[:i]), sum(balance[:i+1])).
from parallel.errors import ParallelConfigError

PARTITION_METHODS = ("uniform", "parameters", "time", "memory")


class PartitionError(ParallelConfigError):
    """A balance does not describe a valid split of the model's blocks."""


def validate_balance(balance: Sequence[int], n_blocks: int, n_stages: int) -> None:
    """Check that ``balance`` splits ``n_blocks`` blocks into ``n_stages`` non-empty stages.

    Raises:
        PartitionError: with the numbers, e.g. "balance [3, 4] sums to 7 but the model has 8 blocks".
    """
    if n_blocks < n_stages:
        raise PartitionError(f"fewer blocks ({n_blocks}) than stages ({n_stages}): every stage needs a block")
    if len(balance) != n_stages:
        raise PartitionError(
            f"balance {list(balance)} has {len(balance)} entries but there are {n_stages} stages"
        )
    bad = [b for b in balance if not isinstance(b, int) or b < 1]
    if bad:
        raise PartitionError(
            f"balance {list(balance)} has non-positive entries {bad}; each stage needs >= 1 block"
        )
    if sum(balance) != n_blocks:
        raise PartitionError(
            f"balance {list(balance)} sums to {sum(balance)} but the model has {n_blocks} blocks"
        )


def uniform_partition(n_blocks: int, n_stages: int) -> list[int]:
    """Equal block counts; the remainder goes one each to the *last* stages.

    Under 1F1B the first stages hold the most in-flight micro-batches (rank r
    holds p - r), so they get the smaller share.
    """
    if n_stages < 1:
        raise PartitionError(f"need at least one stage, got {n_stages}")
    if n_blocks < n_stages:
        raise PartitionError(f"fewer blocks ({n_blocks}) than stages ({n_stages}): every stage needs a block")
    base, extra = divmod(n_blocks, n_stages)
    return [base + (1 if i >= n_stages - extra else 0) for i in range(n_stages)]


def partition_blocks(costs: Sequence[float], n_stages: int) -> list[int]:
    """Contiguous split of blocks into ``n_stages`` non-empty stages minimising the max stage cost.

    Exact O(b^2 k) dynamic programme (b is at most a few hundred). Among optimal
    splits, later stages take as many blocks as they can: earlier stages hold
    more in-flight micro-batches under 1F1B, so they are kept light.

    Returns:
        The balance: block count per stage.

    Raises:
        PartitionError: fewer blocks than stages, or a negative cost.
    """
    n_blocks = len(costs)
    if n_stages < 1:
        raise PartitionError(f"need at least one stage, got {n_stages}")
    if n_blocks < n_stages:
        raise PartitionError(f"fewer blocks ({n_blocks}) than stages ({n_stages}): every stage needs a block")
    if any(c < 0 for c in costs):
        raise PartitionError(f"block costs must be >= 0, got {min(costs)}")
    prefix = _prefix_sums(costs)
    best = _min_max_table(prefix, n_stages)
    return _backtrack(prefix, best, n_stages)


def _prefix_sums(costs: Sequence[float]) -> list[float]:
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    return prefix


def _min_max_table(prefix: list[float], n_stages: int) -> list[list[float]]:
    """best[k][i]: least possible max stage cost when the first i blocks form k stages."""
    n_blocks = len(prefix) - 1
    inf = float("inf")
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n_blocks + 1):
            # the k-th stage is blocks [j, i); the first k-1 stages need j >= k-1 blocks
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    return best


def _backtrack(prefix: list[float], best: list[list[float]], n_stages: int) -> list[int]:
    """Rebuild an optimal split from the back, giving each stage its longest feasible suffix."""
    target = best[n_stages][len(prefix) - 1]
    balance: list[int] = []
    end = len(prefix) - 1
    for k in range(n_stages, 0, -1):
        # smallest start j keeps the stage within target and leaves a feasible prefix
        start = next(
            j for j in range(k - 1, end) if prefix[end] - prefix[j] <= target and best[k - 1][j] <= target
        )
        balance.append(end - start)
        end = start
    return balance[::-1]


def stage_costs(balance: Sequence[int], costs: Sequence[float]) -> list[float]:
    """Sum of the block costs of each stage."""
    validate_balance(balance, len(costs), len(balance))
    out, start = [], 0
    for count in balance:
        out.append(float(sum(costs[start : start + count])))
        start += count
    return out


def resolve_partition(
    method: str | Sequence[int],
    block_names: Sequence[str],
    n_stages: int,
    *,
    param_counts: Sequence[float] | None = None,
    time_costs: Sequence[float] | None = None,
    mem_costs: Sequence[float] | None = None,
) -> list[int]:
    """Turn ``partition_method`` (a name or an explicit balance) into a validated balance.

    Raises:
        ValueError: unknown method, or the cost list it needs is missing or of the wrong length.
        PartitionError: the balance is invalid for this model and stage count.
    """
    n_blocks = len(block_names)
    if not isinstance(method, str):
        balance = list(method)
        validate_balance(balance, n_blocks, n_stages)
        return balance
    if method not in PARTITION_METHODS:
        raise ValueError(
            f"unknown partition_method {method!r}; valid choices: {list(PARTITION_METHODS)} "
            f"or a list of {n_stages} block counts"
        )
    if method == "uniform":
        return uniform_partition(n_blocks, n_stages)
    costs = {"parameters": param_counts, "time": time_costs, "memory": mem_costs}[method]
    if costs is None:
        arg = {"parameters": "param_counts", "time": "time_costs", "memory": "mem_costs"}[method]
        raise ValueError(f"partition_method {method!r} needs {arg}, which was not given")
    if len(costs) != n_blocks:
        raise ValueError(f"partition_method {method!r}: {len(costs)} costs for {n_blocks} blocks")
    return partition_blocks(costs, n_stages)


def format_partition(
    balance: Sequence[int],
    block_names: Sequence[str],
    time_costs: Sequence[float] | None = None,
    mem_costs: Sequence[float] | None = None,
) -> str:
    """One line per stage: its block range and, when given, predicted time and memory (bytes).

    Example::

        stage 0: blocks  0-3  (src_embed .. encoder.2)   time 4.10 (24.6%)  mem 1.2 GiB
    """
    validate_balance(balance, len(block_names), len(balance))
    times = stage_costs(balance, time_costs) if time_costs is not None else None
    mems = stage_costs(balance, mem_costs) if mem_costs is not None else None
    total_time = sum(times) if times else 0.0
    width = max(len(n) for n in block_names)
    lines, start = [], 0
    for i, count in enumerate(balance):
        last = start + count - 1
        line = f"stage {i}: blocks {start:>3}-{last:<3} ({block_names[start]:>{width}} .. {block_names[last]:<{width}})"
        if times is not None:
            share = 100 * times[i] / total_time if total_time else 0.0
            line += f"  time {times[i]:.3g} ({share:.1f}%)"
        if mems is not None:
            line += f"  mem {_human_bytes(mems[i])}"
        lines.append(line)
        start += count
    return "\n".join(lines)


def _human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
