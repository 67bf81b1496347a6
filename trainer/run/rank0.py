"""Work done on rank 0 alone (the tokenizer, tokenizing the data, measuring blocks for balancing),
its outcome shared with every rank in one broadcast: a failure there raises on every rank
instead of leaving the others waiting in the next collective until the timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from trainer.errors import BAD_INPUT

T = TypeVar("T")


def on_rank0(rank: int, what: str, work: Callable[[], T]) -> T | None:
    """Run `work` on rank 0 and tell every rank how it ended (one broadcast), so that a failure
    raises on every rank instead of leaving the others waiting in the next collective.

    Returns:
        `work()`'s result on rank 0, None on the others.

    Raises:
        On rank 0, what `work` raised (with its traceback); on the others the same exception when it
        is bad input (`trainer.errors.BAD_INPUT`), else a RuntimeError naming it.
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
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0]
    return result
