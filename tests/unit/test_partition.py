"""Balancing blocks over stages: optimality against brute force, tie-breaks, errors."""

from __future__ import annotations

import itertools
import random

import pytest

from parallel.pipeline.partition import (
    PartitionError,
    format_partition,
    partition_blocks,
    resolve_partition,
    stage_costs,
    uniform_partition,
    validate_balance,
)


def brute_force_best(costs: list[float], k: int) -> float:
    """Least max stage cost over every composition of len(costs) into k positive parts."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_matches_brute_force_on_random_instances() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [float(rng.choice([0, 1, 2, 3, 5, 8, rng.random() * 10])) for _ in range(n)]
        balance = partition_blocks(costs, k)
        validate_balance(balance, n, k)
        assert max(stage_costs(balance, costs)) == pytest.approx(brute_force_best(costs, k))


def test_integer_costs_exact() -> None:
    # Classic linear-partition instance: 1..9 into 3 parts, best max is 17 (1-5 | 6-7 | 8-9).
    costs = [float(c) for c in range(1, 10)]
    balance = partition_blocks(costs, 3)
    assert max(stage_costs(balance, costs)) == 17.0
    assert balance == [5, 2, 2]


def test_ties_give_later_stages_more_blocks() -> None:
    # Equal blocks, 5 over 2 stages: [2, 3] and [3, 2] both have max 3; earlier
    # stages hold more in-flight micro-batches under 1F1B, so they stay light.
    assert partition_blocks([1.0] * 5, 2) == [2, 3]
    assert partition_blocks([1.0] * 7, 3) == [1, 3, 3]  # max 3 either way; greedy from the back
    assert partition_blocks([0.0] * 4, 2) == [1, 3]


def test_heavy_head_block_gets_its_own_stage() -> None:
    # An output layer as costly as the rest together.
    assert partition_blocks([1.0, 1.0, 1.0, 1.0, 4.0], 2) == [4, 1]


def test_partition_errors() -> None:
    with pytest.raises(PartitionError, match=r"fewer blocks \(3\) than stages \(4\)"):
        partition_blocks([1.0, 1.0, 1.0], 4)
    with pytest.raises(PartitionError, match=r">= 0"):
        partition_blocks([1.0, -1.0], 1)


def test_uniform_partition_puts_the_remainder_last() -> None:
    assert uniform_partition(8, 4) == [2, 2, 2, 2]
    assert uniform_partition(10, 4) == [2, 2, 3, 3]
    assert uniform_partition(3, 3) == [1, 1, 1]
    with pytest.raises(PartitionError, match=r"fewer blocks \(2\) than stages \(3\)"):
        uniform_partition(2, 3)


def test_validate_balance_messages() -> None:
    validate_balance([3, 5], 8, 2)
    with pytest.raises(PartitionError, match=r"balance \[3, 4\] sums to 7 but the model has 8 blocks"):
        validate_balance([3, 4], 8, 2)
    with pytest.raises(PartitionError, match=r"fewer blocks \(3\) than stages \(4\)"):
        validate_balance([1, 1, 1, 0], 3, 4)
    with pytest.raises(PartitionError, match=r"non-positive entries \[0\]"):
        validate_balance([4, 0], 4, 2)
    with pytest.raises(PartitionError, match=r"has 3 entries but there are 2 stages"):
        validate_balance([2, 2, 2], 6, 2)


def test_stage_costs() -> None:
    assert stage_costs([2, 1], [1.0, 2.0, 4.0]) == [3.0, 4.0]


NAMES = ["src_embed", "enc.0", "enc.1", "tgt_embed", "dec.0", "dec.1", "head"]


def test_resolve_partition_methods() -> None:
    assert resolve_partition("uniform", NAMES, 2) == [3, 4]
    params = [10.0, 1.0, 1.0, 0.0, 1.0, 1.0, 10.0]
    assert resolve_partition("parameters", NAMES, 2, param_counts=params) == [3, 4]
    times = [1.0, 2.0, 2.0, 1.0, 3.0, 3.0, 4.0]
    balance = resolve_partition("time", NAMES, 3, time_costs=times)
    assert max(stage_costs(balance, times)) == brute_force_best(times, 3)
    assert resolve_partition("memory", NAMES, 7, mem_costs=[1.0] * 7) == [1] * 7
    assert resolve_partition([2, 5], NAMES, 2) == [2, 5]


def test_resolve_partition_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown partition_method 'speed'; valid choices: \['uniform', "):
        resolve_partition("speed", NAMES, 2)
    with pytest.raises(ValueError, match=r"'time' needs time_costs"):
        resolve_partition("time", NAMES, 2)
    with pytest.raises(ValueError, match=r"'memory': 3 costs for 7 blocks"):
        resolve_partition("memory", NAMES, 2, mem_costs=[1.0, 2.0, 3.0])
    with pytest.raises(PartitionError, match=r"balance \[2, 4\] sums to 6 but the model has 7 blocks"):
        resolve_partition([2, 4], NAMES, 2)
    with pytest.raises(PartitionError, match=r"fewer blocks \(7\) than stages \(8\)"):
        resolve_partition("uniform", NAMES, 8)


def test_format_partition() -> None:
    text = format_partition(
        [3, 4], NAMES, time_costs=[1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0], mem_costs=[2.0**30] * 7
    )
    lines = text.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("stage 0: blocks   0-2")
    assert "src_embed .. enc.1" in lines[0]
    assert "tgt_embed .. head" in lines[1]
    assert "time 3 (30.0%)" in lines[0] and "time 7 (70.0%)" in lines[1]
    assert "mem 3.0 GiB" in lines[0] and "mem 4.0 GiB" in lines[1]
    assert "time" not in format_partition([3, 4], NAMES)
