"""Sharded, resumable checkpoints with `torch.distributed.checkpoint` (DCP).

Layout of `output_dir/checkpoint-<step>/`:

    .metadata, __*.distcp   DCP shards: {"model": {fqn: tensor}, "optim": {fqn: {exp_avg, exp_avg_sq, step}}}
    trainer_state.json      step, scheduler, data position, mesh, partition (rank 0)
    rng/rank-<r>.pt         each rank's RNG states (dropout masks need none: keyed by step, `parallel.rng`)
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
deleted by `save_total_limit` only after a commit, and so is what `overwrite_output_dir` moved
aside (`trainer.run.outdir`). `async_save` (`trainer.checkpoint.async_save`)
writes the shards in the background and commits through the same `finish_save`.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException

from models.errors import CheckpointMismatchError
from trainer.checkpoint.commit import (
    COMMIT_MARKER,
    CheckpointCorruptError,
    FileRecords,
    files_of_rank,
    hash_files,
    is_complete,
    list_checkpoints,
    unlisted_files,
    verify_checkpoint,
    write_marker,
)
from trainer.checkpoint.write_failure import describe_write_failure, failed_here
from trainer.errors import ConfigError
from trainer.run.outdir import discard_earlier_run

logger = logging.getLogger("trainer")

# Maps (fqn, local tensor) -> the tensor to hand to DCP (plain or a DTensor of logical shape), or
# several entries {logical fqn: tensor} (a stacked expert parameter: one per expert, transformers names).
ToLogical = Callable[[str, Tensor], Tensor | dict[str, Tensor]]


def _identity(_: str, t: Tensor) -> Tensor:
    return t


def _entries(to_logical: ToLogical, name: str, t: Tensor) -> dict[str, Tensor]:
    """The checkpoint entries of local tensor `t` of parameter `name`."""
    out = to_logical(name, t)
    return out if isinstance(out, dict) else {name: out}


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
    return {
        e: t
        for k, p in named_trainable(parts).items()
        for e, t in _entries(to_logical, k, p.detach()).items()
    }


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
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, dict[str, Tensor]] = {}
    for name, p in params.items():
        if id(p) not in group_of:
            continue
        st = optimizer.state.get(p)
        if not st:
            if not template:
                continue
            st = {
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
                "step": _initial_step(p, group_of[id(p)]),
            }
            optimizer.state[p] = st
        per_key = {k: (_entries(to_logical, name, v) if v.dim() > 0 else None) for k, v in st.items()}
        entries = next(e for e in per_key.values() if e is not None)  # the logical names
        for entry in entries:
            out[entry] = {k: (st[k] if e is None else e[entry]) for k, e in per_key.items()}
    return out


def _initial_step(p: Tensor, group: dict[str, Any]) -> Tensor:
    """AdamW's step count before any update, where torch keeps it: on the parameter's device for
    fused / capturable optimizers (CUDA), on the CPU otherwise (as `AdamW._init_group` does)."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    return torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


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
            `output_dir` that verifies; a damaged newer one is skipped with a warning; none: None),
            "true" (the HF Trainer's True: as "latest", but there must be one), or a checkpoint
            directory.
        output_dir: the run's output directory.

    Returns:
        The checkpoint to load, or None when there is nothing to resume from.

    Raises:
        FileNotFoundError: the named checkpoint does not exist or is incomplete.
        ConfigError: "true" and no committed checkpoint in `output_dir` (HF: "No valid checkpoint
            found in output directory").
        CheckpointCorruptError: the named checkpoint, or every committed one for "latest" / "true",
            is damaged (the message names the file and expected vs found checksum).
    """
    if spec is None or spec == "":
        return None
    if spec in ("latest", "true"):
        found = _agreed(list_checkpoints(output_dir))
        problems = []
        for cand in reversed(found):
            problem = verify_checkpoint(cand)
            if problem is None:
                return cand
            problems.append(problem)
            if _rank() == 0:
                logger.warning("resume_from_checkpoint=%s: skipping it, %s", spec, problem)
        if found:
            raise CheckpointCorruptError(
                f"resume_from_checkpoint={spec}: every committed checkpoint in {output_dir} is damaged "
                f"({[p.name for p in found]}); the newest: {problems[0]}"
            )
        if spec == "true":
            raise ConfigError(
                f"resume_from_checkpoint=true: no valid checkpoint found in output_dir {str(output_dir)!r} "
                "(true, as in the HF Trainer, needs one); give the checkpoint's directory, or 'latest' to "
                "start from step 0 where there is none"
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
    begin_save(path)
    rank, records, local = _rank(), {}, None
    try:
        dcp.save(checkpoint_state(parts, optimizer, to_logical), checkpoint_id=str(path))
        records = write_side_files(path, trainer_state, rank)
    except (
        Exception,
        CheckpointException,
    ) as e:  # agreed in finish_save: no rank may leave the others waiting
        local = e
    finish_save(path, int(trainer_state.get("step", -1)), records, local, save_total_limit, keep)


def begin_save(path: Path) -> None:
    """Rank 0 clears `path` (an earlier incomplete attempt at this step); collective."""
    if _rank() == 0 and path.exists():
        shutil.rmtree(path)
    _barrier()


def checkpoint_state(
    parts: list[nn.Module], optimizer: torch.optim.Optimizer, to_logical: ToLogical = _identity
) -> dict[str, Any]:
    """What DCP saves: {"model": {fqn: tensor}, "optim": {fqn: {exp_avg, exp_avg_sq, step}}}."""
    params = named_trainable(parts)
    # template: a parameter not updated yet (LayerDrop skipped it every step so far) saves
    # AdamW's initial zeros, so every mesh's load finds every key.
    optim = optimizer_state(optimizer, params, to_logical, template=True)
    return {"model": model_state(parts, to_logical), "optim": optim}


def write_side_files(path: Path, trainer_state: dict[str, Any], rank: int) -> FileRecords:
    """This rank's RNG file and (rank 0) trainer_state.json, beside the DCP shards; their records."""
    rng_dir = path / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), rng_dir / f"rank-{rank}.pt")
    names = [f"rng/rank-{rank}.pt"]
    if rank == 0:
        (path / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        names.append("trainer_state.json")
    return hash_files(path, names)


def finish_save(
    path: Path,
    step: int,
    records: FileRecords,
    local: BaseException | None,
    save_total_limit: int | None = None,
    keep: Path | None = None,
) -> None:
    """The commit of a save whose files are written (collective; see `save_checkpoint`).

    Args:
        path: the checkpoint directory.
        step: the checkpoint's step (in the marker).
        records: this rank's side files (`write_side_files`); its DCP shards are hashed here.
        local: what this rank's writing raised, or None.
        save_total_limit, keep: rotation after a commit (`rotation_victims`).

    Raises:
        CheckpointWriteError: a write failed on some rank (every rank raises it; `path` is removed).
    """
    rank = _rank()
    failure = describe_write_failure(path, local, rank) if local is not None else None
    if failure is None:
        try:
            records = {**records, **hash_files(path, files_of_rank(path, rank))}
        except OSError as e:
            failure, local = describe_write_failure(path, e, rank), e
    gathered = _all_gather((records, failure, failed_here(local, rank)))
    failure = _first_failure([(f, own) for _, f, own in gathered])
    if failure is None and rank == 0:
        try:
            _commit(path, step, {k: v for r, _, _ in gathered for k, v in r.items()})
        except OSError as e:
            failure, local = describe_write_failure(path, e, rank), e
    failure = _agreed(failure)
    if failure is not None:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        _barrier()  # the partial directory is gone on every rank's return
        raise CheckpointWriteError(failure) from local
    if rank == 0:
        discard_earlier_run(
            path.parent
        )  # what overwrite_output_dir moved aside: this run has a checkpoint now
    if rank == 0 and save_total_limit:
        for old in rotation_victims(list_checkpoints(path.parent), save_total_limit, keep):
            shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _first_failure(reports: list[tuple[str | None, bool]]) -> str | None:
    """The lowest failing rank's own account, else any rank's: only a failing rank sees its OSError."""
    own = [f for f, mine in reports if f and mine]
    other = [f for f, _ in reports if f]
    return (own or other)[0] if other else None


def _commit(path: Path, step: int, records: FileRecords) -> None:
    """Rank 0: hash the files no rank claimed (DCP's .metadata), then write the marker."""
    records.update(hash_files(path, unlisted_files(path, records)))
    write_marker(path, step, records)


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
        CheckpointMismatchError: the checkpoint does not fit the model (names or shapes).
    """
    params = named_trainable(parts)
    state: dict[str, Any] = {"model": model_state(parts, to_logical)}
    if optimizer is not None:
        state["optim"] = optimizer_state(optimizer, params, to_logical, template=True)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (CheckpointException, Exception) as e:  # CheckpointException derives from BaseException
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        cause = lines[-1] if lines else type(e).__name__
        raise CheckpointMismatchError(f"checkpoint {path} does not fit this model: {cause[:300]}") from e
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
