"""Work done on rank 0 alone (the tokenizer, tokenizing the data, measuring blocks for balancing),
its outcome shared with every rank in one broadcast: a failure there raises on every rank
instead of leaving the others waiting in the next collective until the timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from trainer.errors import BAD_INPUT

T = TypeVar("T")


def on_rank0(rank: int, what: str, work: Callable[[], T], hint: str = "") -> T | None:
    """Run `work` on rank 0 and tell every rank how it ended (one broadcast), so that a failure
    raises on every rank instead of leaving the others waiting in the next collective.

    Returns:
        `work()`'s result on rank 0, None on the others.

    Raises:
        On rank 0, what `work` raised (with its traceback); on the others the same exception when it
        is bad input (`trainer.errors.BAD_INPUT`), else a RuntimeError naming it. A rank that waits
        past the collective timeout says what rank 0 was doing, with `hint` (instead of gloo's bare
        "Timed out waiting ... for recv").
    """
    result: T | None = None
    outcome: list[BaseException | None] = [None]
    if rank == 0:
        try:
            result = work()
        except Exception as e:
            bad = isinstance(e, BAD_INPUT)
            outcome = [e if bad else RuntimeError(f"rank 0 could not {what}: {type(e).__name__}: {e}")]
            dist.broadcast_object_list(outcome, src=0)
            raise
    try:
        dist.broadcast_object_list(outcome, src=0)
    except RuntimeError as e:
        if rank == 0 or "imed out" not in str(e):
            raise
        raise RuntimeError(
            f"rank {rank} timed out waiting for rank 0 to {what}{hint} ({str(e).splitlines()[0]})"
        ) from e
    if outcome[0] is not None:
        raise outcome[0]
    return result
