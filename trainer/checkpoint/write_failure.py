"""A failed checkpoint write in one line: what failed, on which rank, the free space, what is left.

Used by `trainer.checkpoint.dcp.finish_save` (synchronous and asynchronous saves alike).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.commit import list_checkpoints

_ERRNO_MEANING = {
    errno.ENOSPC: "the disk is full (no space left on device)",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "a file exceeded the largest size allowed (RLIMIT_FSIZE or the file system's limit)",
}


def describe_write_failure(path: Path, exc: BaseException, rank: int) -> str:
    """One line for a failed save: what failed, on which rank, the free space, what is left.

    DCP's writer reports a failed write as torch.save's "unexpected pos 704 vs 598", and
    the OSError behind it survives only as that exception's context on the failing rank
    (pickling across ranks drops it). So the failing rank looks for the OSError in the
    chain and, if it is gone, probes with a fresh write beside the checkpoint.

    Args:
        path: the checkpoint directory being written.
        exc: what this rank caught: an OSError, or DCP's CheckpointException, which
            carries every failing rank's exception.
        rank: this rank.
    """
    failures = exc.failures if isinstance(exc, CheckpointException) else {rank: (exc, None)}
    where = rank if rank in failures else min(failures)
    err = failures[where][0]
    os_err = _os_error_in(err)
    probed = os_err is None and where == rank
    if probed:
        os_err = _probe_write(path)
    cause = _cause(err, os_err, probed)
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    kept = list_checkpoints(path.parent)
    return (
        f"saving checkpoint {path} failed on rank {where}: {cause}; {free} in {path.parent}; "
        f"the partial checkpoint was removed; last committed: {kept[-1].name if kept else 'none'}"
    )


def _cause(err: BaseException, os_err: OSError | None, probed: bool) -> str:
    """What went wrong, in words: the errno's meaning when there is one, else the error's last line."""
    last = next((ln.strip() for ln in reversed(str(err).splitlines()) if ln.strip()), type(err).__name__)
    last = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", last)  # c10's prefix says nothing here
    if os_err is None or os_err.errno is None:
        return f"{type(err).__name__}: {last[:200]}"
    what = _ERRNO_MEANING.get(os_err.errno, "a write failed")
    code = errno.errorcode.get(os_err.errno, str(os_err.errno))
    cause = f"{what} ({code}: {os_err.strerror}{f', {os_err.filename}' if os_err.filename else ''})"
    return cause + (f", found by a probe write after {type(err).__name__}: {last[:120]}" if probed else "")


def failed_here(exc: BaseException | None, rank: int) -> bool:
    if exc is None:
        return False
    return rank in exc.failures if isinstance(exc, CheckpointException) else True


def _os_error_in(exc: BaseException) -> OSError | None:
    """The first OSError along `exc`'s cause/context chain (itself included)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _probe_write(path: Path, size: int = 4 << 20) -> OSError | None:
    """Write and fsync `size` bytes beside the checkpoint; the OSError if that fails (file removed)."""
    probe = path.parent / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            for _ in range(size >> 20):
                f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
        return None
    except OSError as e:
        return e
    finally:
        probe.unlink(missing_ok=True)
