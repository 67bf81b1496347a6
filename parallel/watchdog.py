"""Hangs explained: what this rank is waiting on, errors that say so, and a watchdog thread.

    a blocking wait (p2p receive or send, a collective)
        wait(work, what) / with waiting(what): ...
          slot <- (what, since)        host only: a reference and a monotonic time, no device read
          RuntimeError from the wait -> CommWaitError, raised `from` it:
            "pp rank 1 (pp=1 dp=0 tp=0, global rank 2) waited 30.0 s for the activations of
             micro-batch 3 of stage 1 (RF1.3) from pp rank 0 (global rank 0), then failed: ..."
    the watchdog (one daemon thread per process, `start_watchdog`)
        wakes every `interval_s`; a wait older than `warn_after_s` is logged once, as a
        warning with the same words, well before the collective timeout ends it

`what` is a string or a callable `(RankIdentity | None) -> str`, formatted only
when reported, so the hot path stores a reference and a float per wait.

Gloo waits block the host, so every hang of a CPU run shows here. NCCL waits only
order streams, and a stuck NCCL collective surfaces in NCCL's own watchdog and
flight recorder instead (switched on by `parallel.mesh.nccl_debug_defaults`);
with TORCH_NCCL_BLOCKING_WAIT=1 the waits block and this module reports them too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from parallel.mesh import rank_to_coords

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankIdentity:
    """A global rank and the (pp, dp, tp) mesh shape, for naming ranks in messages."""

    rank: int
    shape: tuple[int, int, int]

    def describe(self) -> str:
        """e.g. "pp rank 1 (pp=1 dp=0 tp=0, global rank 2)"."""
        pp, dp, tp = rank_to_coords(self.rank, self.shape)
        return f"pp rank {pp} (pp={pp} dp={dp} tp={tp}, global rank {self.rank})"

    def peer(self, rank: int) -> str:
        """A pp neighbour, e.g. "pp rank 0 (global rank 0)"."""
        return f"pp rank {rank_to_coords(rank, self.shape)[0]} (global rank {rank})"


What = str | Callable[[RankIdentity | None], str]


class CommWaitError(RuntimeError):
    """A communication wait failed (timeout, dead peer); the message names who waited for what."""


class _Slot:
    """What this process waits on now (set and cleared by the waiting thread, read by the watchdog)."""

    def __init__(self) -> None:
        self.identity: RankIdentity | None = None
        self.current: tuple[int, What, float] | None = None  # (sequence number, what, since)
        self.seq = 0

    def who(self) -> str:
        if self.identity is not None:
            return self.identity.describe()
        return f"global rank {dist.get_rank()}" if dist.is_initialized() else "this process"

    def text(self, what: What) -> str:
        return what if isinstance(what, str) else what(self.identity)


_SLOT = _Slot()


@contextmanager
def waiting(what: What) -> Iterator[None]:
    """Mark the enclosed blocking call as a wait for `what`; wrap its RuntimeError in CommWaitError.

    Raises:
        CommWaitError: the enclosed call raised RuntimeError (raised from it).
    """
    _SLOT.seq += 1
    since = time.monotonic()
    _SLOT.current = (_SLOT.seq, what, since)
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CommWaitError):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CommWaitError(
            f"{_SLOT.who()} waited {time.monotonic() - since:.1f} s for {_SLOT.text(what)}, then failed: "
            f"{first}"
        ) from e
    finally:
        _SLOT.current = None


def wait(work: dist.Work, what: What) -> None:
    """`work.wait()` as a named wait (see `waiting`).

    Raises:
        CommWaitError: the wait timed out or the peer died (raised from gloo's/NCCL's error).
    """
    with waiting(what):
        work.wait()


def default_warn_after(timeout_s: float) -> float:
    """Warn at half the collective timeout, at most after 60 s."""
    return min(60.0, timeout_s / 2)


def start_watchdog(
    identity: RankIdentity | None,
    warn_after_s: float,
    timeout_s: float | None = None,
    interval_s: float | None = None,
) -> None:
    """Name this rank in wait messages and start (once per process) the thread that warns on long waits.

    A second call updates the identity and the thresholds of the running thread.

    Args:
        identity: this rank on the mesh; None names it by global rank only.
        warn_after_s: log a warning when one wait has lasted this long; <= 0 disables warnings.
        timeout_s: the collective timeout, quoted in the warning.
        interval_s: how often the thread looks; default min(5, warn_after_s / 4).
    """
    global _WATCHDOG
    _SLOT.identity = identity
    if warn_after_s <= 0:
        stop_watchdog()
        return
    interval = interval_s if interval_s is not None else min(5.0, max(0.05, warn_after_s / 4))
    if _WATCHDOG is None or not _WATCHDOG.is_alive():
        _WATCHDOG = _Watchdog(warn_after_s, timeout_s, interval)
        _WATCHDOG.start()
    else:
        _WATCHDOG.warn_after_s, _WATCHDOG.timeout_s, _WATCHDOG.interval_s = warn_after_s, timeout_s, interval


def stop_watchdog() -> None:
    """Stop the watchdog thread if one runs (tests; `start_watchdog` with warn_after_s <= 0)."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop.set()
        _WATCHDOG.join(timeout=10)
        _WATCHDOG = None


class _Watchdog(threading.Thread):
    def __init__(self, warn_after_s: float, timeout_s: float | None, interval_s: float) -> None:
        super().__init__(name="polyglot3d-watchdog", daemon=True)
        self.warn_after_s, self.timeout_s, self.interval_s = warn_after_s, timeout_s, interval_s
        self.stop = threading.Event()
        self.warned = -1  # sequence number of the wait last warned about

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            current = _SLOT.current  # one read: the waiting thread may replace it meanwhile
            if current is None or current[0] == self.warned:
                continue
            seq, what, since = current
            waited = time.monotonic() - since
            if waited >= self.warn_after_s:
                self.warned = seq
                limit = f"; the collective timeout is {self.timeout_s:g} s" if self.timeout_s else ""
                logger.warning(
                    "%s has waited %.0f s for %s (warning after %g s%s)",
                    _SLOT.who(),
                    waited,
                    _SLOT.text(what),
                    self.warn_after_s,
                    limit,
                )


_WATCHDOG: _Watchdog | None = None


def collective(name: str, group: dist.ProcessGroup | None) -> What:
    """`what` for a collective: e.g. "the dp all-reduce of gradient bucket 0 over global ranks [0, 2]"."""

    def describe(_: RankIdentity | None) -> str:
        if group is None:
            return f"the {name} over all ranks"
        return f"the {name} over global ranks {dist.get_process_group_ranks(group)}"

    return describe
