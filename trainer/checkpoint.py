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
"""

from __future__ import annotations

import json
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

COMMIT_MARKER = "COMMITTED"
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


def resolve_resume(spec: str | None, output_dir: str | Path) -> Path | None:
    """`resume_from_checkpoint` value -> a complete checkpoint dir (or None).

    Raises:
        FileNotFoundError: the named checkpoint does not exist or is incomplete.
    """
    if spec is None or spec == "":
        return None
    if spec == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"resume_from_checkpoint={spec!r} is not a directory")
    if not is_complete(path):
        raise FileNotFoundError(
            f"resume_from_checkpoint={spec!r} has no {COMMIT_MARKER} marker: the save "
            f"did not finish; valid: {[str(p) for p in list_checkpoints(path.parent)]}"
        )
    return path


def save_checkpoint(
    path: Path,
    parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    to_logical: ToLogical = _identity,
    save_total_limit: int | None = None,
) -> None:
    """Collective: every rank calls it. The marker is written last, so a crash leaves no complete-looking dir."""
    rank = _rank()
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # an earlier incomplete attempt at this step
    _barrier()
    params = named_trainable(parts)
    state = {"model": model_state(parts, to_logical), "optim": optimizer_state(optimizer, params, to_logical)}
    dcp.save(state, checkpoint_id=str(path))
    rng_dir = path / "rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), rng_dir / f"rank-{rank}.pt")
    if rank == 0:
        (path / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    _barrier()
    if rank == 0:
        (path / COMMIT_MARKER).write_text("ok\n")
        if save_total_limit:
            for old in list_checkpoints(path.parent)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()


def load_checkpoint(
    path: Path,
    parts: list[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    to_logical: ToLogical = _identity,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load weights (and optimizer state) into this rank's parts, resharding as needed; returns trainer_state.

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
