"""Sharded, resumable checkpoints with `torch.distributed.checkpoint` (DCP).

Layout of `output_dir/checkpoint-<step>/`:

    .metadata, __*.distcp   DCP shards: {"model": {fqn: tensor}, "optim": {fqn: {exp_avg, exp_avg_sq, step}}}
    trainer_state.json      step, scheduler, data position, mesh, partition (rank 0)
    rng/rank-<r>.pt         each rank's RNG states
    COMMITTED               written last, by rank 0, after a barrier

Every tensor is saved under its single-device name and *logical* (unsharded)
shape: tensor-parallel shards are wrapped as `DTensor`s on the tp sub-mesh, so
DCP writes each shard once and reshards on load; pipeline stages save only the
blocks they hold (names are stable, e.g. `encoder.layers.17.fc1.weight`); dp
replicas are de-duplicated by DCP's planner. Loading on a different (pp, dp, tp)
therefore only needs the new rank's template. A checkpoint without `COMMITTED`
is incomplete (a crash mid-save) and is never chosen to resume from.

Integrity (`trainer.checkpoint.commit`): the marker records every file's size and crc32, and
`resolve_resume` verifies them before DCP reads anything; `latest` falls back to
the newest checkpoint that verifies, with a warning; a named one that does not is
an error naming the file. A failed write on any rank (ENOSPC, EDQUOT, EFBIG, EIO,
...) is agreed by all ranks, the partial directory is removed and every rank raises
`CheckpointWriteError` naming the cause and the free space; older checkpoints are
deleted by `save_total_limit` only after a commit.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.commit import (
    COMMIT_MARKER,
    CheckpointCorruptError,
    FileRecords,
    files_of_rank,
    hash_files,
    unlisted_files,
    verify_checkpoint,
    write_marker,
)

logger = logging.getLogger("trainer")
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")

# Maps (fqn, local tensor) -> the tensor to hand to DCP (plain or a DTensor of logical shape).
ToLogical = Callable[[str, Tensor], Tensor]


def _identity(_: str, t: Tensor) -> Tensor:
    return t


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def named_trainable(parts: list[nn.Module]) -> dict[str, nn.Parameter]:
    """fqn -> parameter over this rank's model parts (tied copies appear once)."""
    out: dict[str, nn.Parameter] = {}
    for part in parts:
        for name, p in part.named_parameters():
            out.setdefault(name, p)
    return out


def model_state(parts: list[nn.Module], to_logical: ToLogical = _identity) -> dict[str, Tensor]:
    return {k: to_logical(k, p.detach()) for k, p in named_trainable(parts).items()}


def optimizer_state(
    optimizer: torch.optim.Optimizer,
    params: dict[str, nn.Parameter],
    to_logical: ToLogical = _identity,
    template: bool = False,
) -> dict[str, dict[str, Tensor]]:
    """Per-parameter AdamW state keyed by fqn; with `template`, zeros where state is missing.

    Only parameters this optimizer updates are included (a ZeRO-1 rank's share), so
    dp replicas together save, and load, each parameter's state once.
    """
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, dict[str, Tensor]] = {}
    for name, p in params.items():
        if id(p) not in mine:
            continue
        st = optimizer.state.get(p)
        if not st:
            if not template:
                continue
            st = {
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
                "step": torch.zeros((), dtype=torch.float32),
            }
            optimizer.state[p] = st
        out[name] = {k: (to_logical(name, v) if v.dim() > 0 else v) for k, v in st.items()}
    return out


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMMIT_MARKER).is_file()


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CKPT_RE.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def rotation_victims(checkpoints: list[Path], limit: int, keep: Path | None = None) -> list[Path]:
    """The checkpoints (oldest first) that `save_total_limit=limit` deletes, as the HF Trainer does.

    Without `keep`, all but the newest `limit`. With `keep` (the best checkpoint) among them,
    it stays and the newest `limit - 1` others do (at least the newest one, so limit 1 keeps
    the best and the last).
    """
    if keep is None or Path(keep) not in checkpoints:
        return checkpoints[:-limit]
    others = [c for c in checkpoints if c != Path(keep)]
    return others[: -max(1, limit - 1)]


class CheckpointWriteError(OSError):
    """A checkpoint save failed on some rank (disk full, quota, file size limit, I/O error).

    Raised on every rank, with the same message; the partial directory is gone.
    """


def resolve_resume(spec: str | None, output_dir: str | Path) -> Path | None:
    """`resume_from_checkpoint` value -> a committed checkpoint dir whose files verify (or None).

    Collective when a process group is initialised (the ranks share the verification and
    agree on it; rank 0's listing of `output_dir` is the one used).

    Args:
        spec: None or "" (start fresh), "latest" (the newest committed checkpoint in
            `output_dir` that verifies; a damaged newer one is skipped with a warning),
            or a checkpoint directory.
        output_dir: the run's output directory.

    Returns:
        The checkpoint to load, or None when there is nothing to resume from.

    Raises:
        FileNotFoundError: the named checkpoint does not exist or is incomplete.
        CheckpointCorruptError: the named checkpoint, or every committed one for "latest",
            is damaged (the message names the file and expected vs found checksum).
    """
    if spec is None or spec == "":
        return None
    if spec == "latest":
        found = _agreed(list_checkpoints(output_dir))
        problems = []
        for cand in reversed(found):
            problem = verify_checkpoint(cand)
            if problem is None:
                return cand
            problems.append(problem)
            if _rank() == 0:
                logger.warning("resume_from_checkpoint=latest: skipping it, %s", problem)
        if found:
            raise CheckpointCorruptError(
                f"resume_from_checkpoint=latest: every committed checkpoint in {output_dir} is damaged "
                f"({[p.name for p in found]}); the newest: {problems[0]}"
            )
        return None
    path = Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint={spec!r} is not a directory")
    if not is_complete(path):
        raise FileNotFoundError(
            f"resume_from_checkpoint={spec!r} has no {COMMIT_MARKER} marker: the save "
            f"did not finish; valid: {[str(p) for p in list_checkpoints(path.parent)]}"
        )
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointCorruptError(problem)
    return path


def save_checkpoint(
    path: Path,
    parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    to_logical: ToLogical = _identity,
    save_total_limit: int | None = None,
    keep: Path | None = None,
) -> None:
    """Write checkpoint `path` (collective: every rank calls it); the checksummed marker last.

    `keep` (the best checkpoint, load_best_model_at_end) survives save_total_limit
    (`rotation_victims`).

        rank 0 clears path -> every rank: DCP shards, its rng file, the hashes of its files
        (rank 0: trainer_state.json too) -> all_gather (records, failure) -> rank 0: hashes
        the rest, writes COMMITTED -> broadcast of the outcome -> on success only, rank 0
        applies save_total_limit; on failure, rank 0 removes `path` and every rank raises

    A crash leaves no directory with a marker; a failed write anywhere is seen by all.

    Raises:
        CheckpointWriteError: a write failed on some rank (every rank raises it; the
            partial directory is removed; older checkpoints are untouched).
    """
    rank = _rank()
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # an earlier incomplete attempt at this step
    _barrier()
    records: FileRecords = {}
    failure: str | None = None
    local: BaseException | None = None
    try:
        records = _write_rank_files(path, parts, optimizer, trainer_state, to_logical, rank)
    except (Exception, CheckpointException) as e:  # agreed below: no rank may leave the others waiting
        failure, local = describe_write_failure(path, e, rank), e
    gathered = _all_gather((records, failure, _failed_here(local, rank)))
    failure = _first_failure([(f, own) for _, f, own in gathered])
    if failure is None and rank == 0:
        try:
            _commit(
                path, int(trainer_state.get("step", -1)), {k: v for r, _, _ in gathered for k, v in r.items()}
            )
        except OSError as e:
            failure, local = describe_write_failure(path, e, rank), e
    failure = _agreed(failure)
    if failure is not None:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        _barrier()  # the partial directory is gone on every rank's return
        raise CheckpointWriteError(failure) from local
    if rank == 0 and save_total_limit:
        for old in rotation_victims(list_checkpoints(path.parent), save_total_limit, keep):
            shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _first_failure(reports: list[tuple[str | None, bool]]) -> str | None:
    """The lowest failing rank's own account, else any rank's: only a failing rank sees its OSError."""
    own = [f for f, mine in reports if f and mine]
    other = [f for f, _ in reports if f]
    return (own or other)[0] if other else None


def _write_rank_files(
    path: Path,
    parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    to_logical: ToLogical,
    rank: int,
) -> FileRecords:
    """DCP shards (collective), this rank's RNG file, rank 0's trainer_state.json; their records."""
    params = named_trainable(parts)
    # template: a parameter not updated yet (LayerDrop skipped it every step so far) saves
    # AdamW's initial zeros, so every mesh's load finds every key.
    optim = optimizer_state(optimizer, params, to_logical, template=True)
    state = {"model": model_state(parts, to_logical), "optim": optim}
    dcp.save(state, checkpoint_id=str(path))
    rng_dir = path / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), rng_dir / f"rank-{rank}.pt")
    names = files_of_rank(path, rank)
    if rank == 0:
        (path / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        names.append("trainer_state.json")
    return hash_files(path, names)


def _commit(path: Path, step: int, records: FileRecords) -> None:
    """Rank 0: hash the files no rank claimed (DCP's .metadata), then write the marker."""
    records.update(hash_files(path, unlisted_files(path, records)))
    write_marker(path, step, records)


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


def _failed_here(exc: BaseException | None, rank: int) -> bool:
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


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agreed(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_checkpoint(
    path: Path,
    parts: list[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    to_logical: ToLogical = _identity,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load weights (and optimizer state) into this rank's parts, resharding as needed; returns trainer_state.

    `path` comes from `resolve_resume`, which has verified its files against the marker.

    Raises:
        ValueError: the checkpoint does not fit the model (names or shapes).
    """
    params = named_trainable(parts)
    model_tpl = {k: to_logical(k, p.detach()) for k, p in params.items()}
    state: dict[str, Any] = {"model": model_tpl}
    if optimizer is not None:
        state["optim"] = optimizer_state(optimizer, params, to_logical, template=True)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (CheckpointException, Exception) as e:  # CheckpointException derives from BaseException
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        cause = lines[-1] if lines else type(e).__name__
        raise ValueError(f"checkpoint {path} does not fit this model: {cause[:300]}") from e
    # DCP loads in place into local tensors / DTensor local shards, which alias our params and state.
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    rng_file = path / "rng" / f"rank-{_rank()}.pt"
    if restore_rng and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    st: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
