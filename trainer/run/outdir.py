"""The output directory: one run at a time, and what a fresh start clears.

    with claim_output_dir(cfg.training, rank) as out:   # collective; rank 0 holds the lock inside
        ...the whole run...

Lock. Rank 0 takes `fcntl.flock(LOCK_EX | LOCK_NB)` on `output_dir/.lock` before
anything else is written there, and writes its holder (host, pid, start time,
command) into the file. A second run on the same directory fails at once with one
line naming that holder. The OS drops the lock when the holding process exits or
dies, so a crashed run never blocks the next one and a `torchrun --max-restarts`
attempt can take it (a restarted rank 0 retries for RESTART_LOCK_WAIT_S while the
dead attempt's processes are reaped). The file is never deleted: a run deleting it
while another opens it would let two runs lock two different files. Linux NFS
clients map flock onto NFS byte-range locks, so the lock also holds across nodes
that share the directory over NFS.

Fresh start. A run is fresh when it has no `resume_from_checkpoint` and is not a
torchrun restart (TORCHELASTIC_RESTART_COUNT unset or 0). A fresh run refuses a
non-empty directory unless `overwrite_output_dir` (off by default, as in `transformers`, and set
by no shipped config: rerunning a command never deletes its earlier run), in one line naming
what is there (`checkpoint-100..800 (8 checkpoints)`, ...) and the ways on: resume, overwrite,
another directory. With `overwrite_output_dir`, the earlier run's outputs
(RUN_OUTPUTS and every `checkpoint-<step>/`) are moved aside into `EARLIER_RUN/` (a rename,
before anything else is written), so `resume_from_checkpoint: latest` can never pick another
run's checkpoint, and nothing is lost until this run has a checkpoint of its own: they are
removed when it commits its first one (`discard_earlier_run`, called by the checkpoint
commit), and the log says so at both moments. Until then the earlier run can be restored by
moving them back. A fresh start that finds `EARLIER_RUN/` already there (the run between
committed nothing) keeps it and removes the outputs of that run instead, unless they hold a
committed checkpoint, which then replaces it. Other files (a user's notes, an export,
`wandb/`, whose runs have their own ids) are left alone (`transformers` never deleted
anything for `overwrite_output_dir`). A restart of the same run has the same flags but is not
fresh: it keeps its checkpoints. (A run id recorded in each checkpoint, so that `latest`
picks only "this run's", was considered and left out: after the fresh-start move every
checkpoint in the directory is this run's or one it resumed from.)

The decision is rank 0's; it is broadcast, so a refused run raises the same error on
every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import BadInputError, ConfigError

if TYPE_CHECKING:
    from trainer.config.training_args import TrainingArguments
# torch and trainer.config (transformers) are imported where used: taking or checking the
# lock from another process (a test, a scheduler's pre-check) needs only the standard library.

LOCK_NAME = ".lock"
RESTART_LOCK_WAIT_S = 30.0
# What a run writes into output_dir besides its checkpoints (see docs/training.md, "Outputs").
RUN_OUTPUTS = (
    "metrics.jsonl",
    "run_summary.json",
    "timeline.png",
    "timeline_trace.json",
    "curves.png",
    "config.yaml",
    "model_config.json",
    "tokenizer",
    "runs",  # TensorBoard: one directory, so an earlier run's event files would mix into the new curves
    "predict_results.json",  # do_predict (trainer.eval.predict), with the files _PREDICTIONS_RE names
    "generated_predictions.txt",
)
_CKPT_RE = re.compile(r"^checkpoint-\d+$")
_PREDICTIONS_RE = re.compile(r"^predictions_.+\.txt$")  # predictions_<direction>.txt
EARLIER_RUN = "overwritten_run"  # where overwrite_output_dir moves the earlier run until this one commits
logger = logging.getLogger("trainer")


class OutputDirBusyError(BadInputError):
    """Another live process holds the output directory's lock; the message names it."""


def restart_count() -> int:
    """How many times torchrun has restarted this run's workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class OutputDirLock:
    """An exclusive, process-lifetime lock on `directory/.lock` (fcntl.flock)."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock (retrying for up to `wait_s` seconds) and record this process as holder.

        Raises:
            OutputDirBusyError: another process holds it; the message names the holder.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's record stays
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self.holder()
                    os.close(fd)
                    raise OutputDirBusyError(
                        f"output_dir={str(self.path.parent)!r} is in use by another run ({holder}); "
                        f"wait for it to finish or choose another output_dir"
                    ) from None
                time.sleep(0.5)
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd

    def holder(self) -> str:
        """The recorded holder, as "host H, pid P, since T, command C" (best effort)."""
        try:
            rec = json.loads(self.path.read_text())
            return f"host {rec['host']}, pid {rec['pid']}, since {rec['since']}, command {rec['command']!r}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder not recorded yet"

    def release(self) -> None:
        """Drop the lock (the file stays); a no-op when not held."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def prepare_fresh_start(out: Path, args: TrainingArguments) -> None:
    """Refuse a non-empty `out` without overwrite_output_dir; with it, move the earlier run's outputs
    aside into `out/EARLIER_RUN` (module docstring).

    Call only for a fresh run (no resume, not a restart), with the lock held.

    Raises:
        ConfigError: `out` holds files and overwrite_output_dir is off.
    """
    present = [p for p in out.iterdir() if p.name not in (LOCK_NAME, EARLIER_RUN)]
    if not present and not (out / EARLIER_RUN).exists():
        return
    if not args.overwrite_output_dir:
        raise ConfigError(_refusal(out, present))
    from trainer.checkpoint.commit import is_complete

    ours = sorted(p for p in present if _is_run_output(p))
    held = out / EARLIER_RUN
    if held.exists() and not any(is_complete(p) for p in ours):  # the run between committed nothing
        for p in ours:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        dropped = f" (removed {len(ours)} outputs of a run that committed none)" if ours else ""
        logger.info("overwrite_output_dir: the earlier run stays in %s until this run commits a checkpoint%s",
                    held, dropped)  # fmt: skip
        return
    if not ours:
        return
    if held.exists():
        shutil.rmtree(held)
    held.mkdir()
    for p in ours:
        p.rename(held / p.name)
    names = ", ".join(p.name for p in ours)
    logger.info("overwrite_output_dir: moved the earlier run's outputs (%s) to %s; they are removed when "
                "this run commits its first checkpoint", names, held)  # fmt: skip


def _refusal(out: Path, present: list[Path]) -> str:
    """The one line that refuses a fresh run on `out`: what is there, and the ways on (as the HF
    Trainer's "Output directory ... already exists and is not empty", with the contents named)."""
    steps = sorted(int(p.name.split("-")[1]) for p in present if _CKPT_RE.match(p.name) and p.is_dir())
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in present if not _CKPT_RE.match(p.name))
    if (out / EARLIER_RUN).exists():
        others.insert(0, f"{EARLIER_RUN}/ (a run moved aside by overwrite_output_dir)")
    what = []
    if steps:
        n = len(steps)
        what.append(
            f"checkpoint-{steps[0]}" if n == 1 else f"checkpoint-{steps[0]}..{steps[-1]} ({n} checkpoints)"
        )
    what += others[:4] + ([f"{len(others) - 4} more"] if len(others) > 4 else [])
    ways = ["continue that run with --resume_from_checkpoint latest"] if steps else []
    ways += [
        "start over with --overwrite_output_dir true (a run's outputs are moved aside, then deleted once "
        "this run commits a checkpoint)",
        "choose another --output_dir",
    ]
    return (
        f"output_dir={str(out)!r} already exists and is not empty ({', '.join(what)}); nothing was "
        f"written: {'; '.join(ways[:-1])}; or {ways[-1]}"
    )


def _is_run_output(p: Path) -> bool:
    """What a run writes into output_dir (RUN_OUTPUTS, its checkpoints and predictions)."""
    return (
        p.name in RUN_OUTPUTS
        or bool(_CKPT_RE.match(p.name) and p.is_dir())
        or bool(_PREDICTIONS_RE.match(p.name))
    )


def discard_earlier_run(out: Path) -> None:
    """Rank 0, after a checkpoint of this run is committed: remove what overwrite_output_dir moved aside."""
    held = out / EARLIER_RUN
    if not held.exists():
        return
    names = sorted(p.name for p in held.iterdir())
    shutil.rmtree(held, ignore_errors=True)
    logger.info("this run committed a checkpoint: removed the earlier run's outputs moved aside by "
                "overwrite_output_dir (%s)", ", ".join(names))  # fmt: skip


@contextmanager
def claim_output_dir(args: TrainingArguments, rank: int) -> Iterator[Path]:
    """Lock `output_dir` on rank 0 for the block's life; prepare it for a fresh start (collective).

    Args:
        args: the run's training arguments (output_dir, overwrite_output_dir, resume_from_checkpoint).
        rank: this process's global rank.

    Returns:
        (as the context value) the output directory, created.

    Raises:
        OutputDirBusyError: another run holds the directory (on every rank).
        ConfigError: a fresh run on a non-empty directory without overwrite_output_dir (on every rank).
    """
    import torch.distributed as dist

    out = Path(args.output_dir)
    lock = OutputDirLock(out)
    error: BaseException | None = None
    if rank == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
            lock.acquire(wait_s=RESTART_LOCK_WAIT_S if restart_count() > 0 else 0.0)
            if not args.resume_from_checkpoint and restart_count() == 0:
                prepare_fresh_start(out, args)
        except (ValueError, OSError) as e:
            lock.release()
            error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if rank != 0 and box[0] is not None:
            raise box[0]
    if error is not None:
        raise error
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    finally:
        lock.release()
