"""Where the stream's chunks are read and tokenized: in the training process, or in worker processes
that run ahead (`dataloader_num_workers`, `dataloader_prefetch_factor`).

Both give the same chunks in the same order (`trainer.data.stream`): worker w reads the lanes
c with c % W == w, in the stream's order, into its own bounded queue; the training process walks
the schedule and takes each chunk from the queue of the lane's worker. A restart (resume) sends
every worker the snapshot with a new generation number; chunks of an older generation are dropped.

A worker's failure (bad data above `max_bad_record_fraction`, an unreadable shard) reaches the
training process as the same exception; a worker that dies is named with its exit code. Every
rank reads the same data, so every rank fails at the same step: no collective is left waiting.
A worker ignores the signals that stop a run (its rank saves and exits, then tells it to) and dies
with its rank (`trainer.lifetime.ParentWatch`).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import traceback
from typing import Any

from trainer.data.stream import Chunk, ChunkReader, Snapshot, StreamSpec, owned_lanes
from trainer.errors import BadInputError, ConfigError
from trainer.lifetime import ParentWatch, ignore_stop_signals

_POLL_S = 0.2


class InlineChunks:
    """The stream read in the training process (`dataloader_num_workers: 0`)."""

    def __init__(self, spec: StreamSpec, tokenizer: Any) -> None:
        self.spec, self.tok = spec, tokenizer
        self.reader = ChunkReader(spec, tokenizer, Snapshot.start(spec))

    def restart(self, snapshot: Snapshot) -> None:
        self.reader.close()
        self.reader = ChunkReader(self.spec, self.tok, snapshot)

    def snapshot(self) -> Snapshot:
        """The position before the next chunk."""
        return self.reader.snap.copy()

    def next_chunk(self) -> Chunk | None:
        """The next chunk, or None at the end of a proportional epoch (the next call starts the next)."""
        return self.reader.next_chunk()

    def close(self) -> None:
        self.reader.close()


class WorkerChunks:
    """The stream read by `num_workers` forked processes, each `prefetch` chunks ahead at most."""

    def __init__(self, spec: StreamSpec, tokenizer: Any, num_workers: int, prefetch: int) -> None:
        if mp.current_process().daemon:
            raise ConfigError(
                f"dataloader_num_workers={num_workers}: this training process is a daemonic process, which "
                "cannot start worker processes; set dataloader_num_workers: 0"
            )
        self.spec = spec
        self.num_workers = max(1, min(num_workers, len(spec.lanes())))  # a worker without lanes idles
        ctx = mp.get_context("fork")  # the tokenizer is inherited, not pickled; workers never touch torch
        self.commands = [ctx.Queue() for _ in range(self.num_workers)]
        self.outputs = [ctx.Queue(maxsize=max(2, prefetch)) for _ in range(self.num_workers)]
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(w, self.num_workers, spec, tokenizer, self.commands[w], self.outputs[w]),
                name=f"data-worker-{w}",
                daemon=True,
            )
            for w in range(self.num_workers)
        ]
        for p in self.procs:
            p.start()
        self.generation = 0
        self.snap = Snapshot.start(spec)
        self.restart(self.snap)

    def restart(self, snapshot: Snapshot) -> None:
        self.generation += 1
        self.snap = snapshot.copy()
        for q in self.commands:
            q.put(("start", self.generation, snapshot.to_dict()))

    def snapshot(self) -> Snapshot:
        return self.snap.copy()

    def next_chunk(self) -> Chunk | None:
        lane = self.snap.next_lane(self.spec)
        if lane is None:  # every worker ends the epoch with one marker
            for w in range(self.num_workers):
                self._expect(w, None)
            self.snap = Snapshot.start(self.spec, self.snap.epoch + 1)
            return None
        chunk = self._expect(lane % self.num_workers, lane)
        assert chunk is not None
        self.snap.advance(lane, chunk.lane_state, chunk.done)
        return chunk

    def _expect(self, w: int, lane: int | None) -> Chunk | None:
        """Worker w's next message of this generation: the chunk of `lane`, or the epoch's end marker."""
        while True:
            try:
                generation, kind, payload = self.outputs[w].get(timeout=_POLL_S * 5)
            except queue.Empty:
                if not self.procs[w].is_alive():
                    raise RuntimeError(
                        f"data worker {w} died (exit code {self.procs[w].exitcode}); its lanes cannot be read"
                    ) from None
                continue
            if generation != self.generation:
                continue
            if kind == "error":
                self.close()
                raise payload
            got = None if payload is None else payload.lane
            if got != lane:
                raise RuntimeError(f"data worker {w} sent lane {got} where the stream expects lane {lane}")
            return payload

    def close(self) -> None:
        for q in self.commands:
            try:
                q.put(("exit", 0, None))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.terminate()
        for q in self.outputs:  # let the feeder threads go
            q.cancel_join_thread()
        self.procs = []


def _worker_main(w: int, num_workers: int, spec: StreamSpec, tokenizer: Any, commands: Any, out: Any) -> None:
    """A worker: wait for a start, then read its lanes' chunks into `out` until told otherwise."""
    ignore_stop_signals()  # Ctrl-C reaches the whole process group, SLURM every process: the rank decides
    parent = ParentWatch(signal.SIGKILL)  # a rank killed with SIGKILL never stops its children
    reader: ChunkReader | None = None
    generation = 0
    owned = owned_lanes(spec, w, num_workers)
    pending: tuple[int, str, Any] | None = None
    while True:
        if parent.gone():  # orphaned where the kernel's signal did not come (not Linux, or a race)
            return
        try:
            idle = reader is None and pending is None
            command = commands.get(block=idle, timeout=_POLL_S * 5 if idle else None)
        except queue.Empty:
            command = None
        if command is not None:
            kind, generation, state = command
            if kind == "exit":  # what is still queued for the training process is not wanted: exit
                out.cancel_join_thread()  # now, not after close()'s join timeout (2 s per worker)
                return
            if reader is not None:
                reader.close()
            reader, pending = ChunkReader(spec, tokenizer, Snapshot.from_dict(state), owned), None
            continue
        if pending is None and reader is not None:
            try:
                pending = (generation, "chunk", reader.next_chunk())
            except Exception as e:  # sent to the training process, which raises it
                pending, reader = (generation, "error", _portable(e, w)), None
        if pending is not None:
            try:
                out.put(pending, timeout=_POLL_S)
                pending = None
            except queue.Full:
                continue


def _portable(e: Exception, w: int) -> Exception:
    """Bad input as itself (one line, exit 2); anything else with the worker's traceback."""
    if isinstance(e, BadInputError):
        return e
    return RuntimeError(f"data worker {w}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
