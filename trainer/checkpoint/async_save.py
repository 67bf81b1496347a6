"""Checkpoint saves in the background (`async_save: true`), with the guarantees of a synchronous save.

    step N    save(N): wait(previous) -> clear dir -> stage (copy to host) -> DCP writes in a thread
    step N+1  training runs while the thread writes; DCP's plan exchange uses a gloo group of its own
    ...
    save(M) / end of training / preemption / load_best_model_at_end: wait()
              future.result() -> hash this rank's files -> agree (all ranks) -> rank 0 writes
              COMMITTED -> rotation (`save_total_limit`); a failure on any rank -> every rank
              raises CheckpointWriteError, the partial directory removed (`dcp.finish_save`)

`dcp.async_save` stages the state into fresh host memory before it returns (`DefaultStager`,
synchronous staging), so the optimizer may update the parameters at once; the writing thread
(`AsyncCheckpointerType.THREAD`) runs DCP's planning collectives on a process group created
for it (gloo, so CPU collectives are possible under NCCL too): two threads must never issue
collectives on the same group. The commit is the synchronous save's (`finish_save`), run from
the main thread at the next wait, so a checkpoint without its marker is never trusted and a
failed write surfaces there, agreed by every rank. At most one save is in flight: the next
save waits for it, so host memory holds one staged copy.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.commit import FileRecords
from trainer.checkpoint.dcp import (
    ToLogical,
    begin_save,
    checkpoint_state,
    finish_save,
    save_checkpoint,
    write_side_files,
)

logger = logging.getLogger("trainer")


@dataclass
class _Pending:
    """A save whose files are being written; committed by `CheckpointSaver.wait`."""

    path: Path
    step: int
    future: Future[Any] | None  # None: starting it failed (`local` says why)
    records: FileRecords
    local: BaseException | None
    save_total_limit: int | None
    keep: Path | None


@dataclass
class CheckpointSaver:
    """The run's checkpoint writer: synchronous, or asynchronous with one save in flight.

    Every rank holds one and calls `save` and `wait` at the same points (both are collective).
    """

    _pending: _Pending | None = None
    _group: Any = field(default=None, repr=False)  # the writer thread's process group

    @property
    def pending(self) -> Path | None:
        """The checkpoint being written and not yet committed, if any."""
        return self._pending.path if self._pending else None

    def save(
        self,
        path: Path,
        parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        to_logical: ToLogical,
        save_total_limit: int | None = None,
        keep: Path | None = None,
        asynchronous: bool = False,
    ) -> None:
        """Write checkpoint `path` (collective): now, or (asynchronous) start it and return.

        An earlier asynchronous save is waited for (and committed) first.

        Raises:
            CheckpointWriteError: this save (synchronous) or the earlier one failed on some rank.
        """
        self.wait()
        if not asynchronous:
            save_checkpoint(path, parts, optimizer, trainer_state, to_logical, save_total_limit, keep)
            return
        begin_save(path)
        rank = dist.get_rank() if dist.is_initialized() else 0
        future: Future[Any] | None = None
        records: FileRecords = {}
        local: BaseException | None = None
        try:
            state = checkpoint_state(parts, optimizer, to_logical)
            future = _as_future(
                dcp.async_save(state, checkpoint_id=str(path), process_group=self._writer_group())
            )
            records = write_side_files(path, trainer_state, rank)
        except (Exception, CheckpointException) as e:  # agreed at the wait, as a failed write is
            local = e
        step = int(trainer_state.get("step", -1))
        self._pending = _Pending(path, step, future, records, local, save_total_limit, keep)

    def wait(self) -> None:
        """Finish the save in flight, if any: its writes, then the agreed commit (collective).

        Raises:
            CheckpointWriteError: it failed on some rank (every rank raises; its directory is removed).
        """
        p, self._pending = self._pending, None
        if p is None:
            return
        local = p.local
        if p.future is not None:
            try:
                p.future.result()
            except (Exception, CheckpointException) as e:
                local = local or e
        finish_save(p.path, p.step, p.records, local, p.save_total_limit, p.keep)
        logger.info("checkpoint %s committed (asynchronous save)", p.path)

    def _writer_group(self) -> Any:
        """A gloo group over the world for the writer thread (made once, on the first async save)."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group


def _as_future(response: Any) -> Future[Any]:
    """`dcp.async_save`'s upload future (an `AsyncSaveResponse` holds it beside staging's)."""
    return response.upload_completion if hasattr(response, "upload_completion") else response
