"""Global batches from the chunk stream, window by window: the streaming twin of
`trainer.data.batching.GlobalBatchSampler`, with the same batch contract and interface.

    chunks (trainer.data.stream) -> window of W examples -> shuffle (seed, epoch, window) ->
    sort by length -> cut into global batches (B pairs x K slots, or token-capped slots) ->
    shuffle their order -> served one per step; a dp replica fetches only its own slots

W is a whole number of global batches of pairs (`stream_geometry`), so a window never leaves
examples behind: it ends inside a chunk and the next window starts there. Only the end of a
proportional epoch leaves fewer than one global batch (dropped and counted, `dropped_tail`, as
the map-style sampler drops its last partial batch). Token-capped windows complete their last
global batch by halving slots (`_token_slots`).

Memory is the window (W examples' ids) plus the chunks read ahead, whatever the corpus size.
The state (`state_dict`) is the stream snapshot before the chunk where the current window
starts, the offset into it, and how many of the window's global batches were served: a resume
rebuilds the window from there, on any mesh with the same global batch.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from models.m2m100 import Seq2SeqBatch
from trainer.data.batching import (
    CHUNK_GLOBAL_BATCHES,
    BatchLayout,
    GlobalBatch,
    _sentence_slots,
    _token_slots,
    bucket,
    collate,
    padded_positions,
)
from trainer.data.sampling import served_shares, window_shares
from trainer.data.shards import fingerprint
from trainer.data.sources import direction_name
from trainer.data.stream import (
    CHUNK_RECORDS,
    MIN_CHUNK_RECORDS,
    SKIP_KEYS,
    Chunk,
    Snapshot,
    StreamSpec,
    merge_counts,
)
from trainer.errors import DataError

logger = logging.getLogger(__name__)
WINDOW_EXAMPLES_CAP = 1 << 17  # a window holds at most this many examples
WINDOW_CHUNKS = 32  # and at least this many chunks' worth (mixing lanes and directions)


def stream_geometry(layout: BatchLayout, max_length: int, lanes: int) -> tuple[int, int]:
    """(R, W): records per chunk and examples per window, from the global batch and the lanes.

    W0 is `CHUNK_GLOBAL_BATCHES` global batches (at most `WINDOW_EXAMPLES_CAP` examples, at least
    one global batch); R is small enough that a window of W0 takes two chunks from every lane,
    within [`MIN_CHUNK_RECORDS`, `CHUNK_RECORDS`]; W is W0, raised to `WINDOW_CHUNKS` chunks' worth
    in whole global batches. A token-capped global batch counts as the examples that fill it at
    the longest length."""
    g = layout.global_batch_size
    if g is None:
        longest = bucket(max(1, max_length), layout.pad_to_multiple_of)
        per_slot = max(1, (layout.max_tokens_per_microbatch or 1) // longest)
        g = per_slot * layout.num_slots
    cap = max(1, WINDOW_EXAMPLES_CAP // g)
    w0 = g * min(CHUNK_GLOBAL_BATCHES, cap)
    r = max(MIN_CHUNK_RECORDS, min(CHUNK_RECORDS, w0 // (2 * max(1, lanes))))
    return r, g * min(max(CHUNK_GLOBAL_BATCHES, -(-WINDOW_CHUNKS * r // g)), cap)


class Window:
    """The examples of one window: flat ids with offsets (one array per side), lengths, directions."""

    def __init__(self, parts: list[tuple[Chunk, int, int]]) -> None:
        def cat(side: str) -> tuple[np.ndarray, np.ndarray]:
            ids, lengths = [], []
            for chunk, a, b in parts:
                off = getattr(chunk, f"{side}_off")
                ids.append(getattr(chunk, side)[off[a] : off[b]])
                lengths.append(np.diff(off[a : b + 1]))
            flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
            length = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
            offsets = np.zeros(len(length) + 1, np.int64)
            np.cumsum(length, out=offsets[1:])
            return flat, offsets

        self.src, self.src_off = cat("src")
        self.tgt, self.tgt_off = cat("tgt")
        self.src_len, self.tgt_len = np.diff(self.src_off), np.diff(self.tgt_off)
        dirs = [chunk.direction[a:b] for chunk, a, b in parts]
        self.direction = np.concatenate(dirs) if dirs else np.zeros(0, np.int16)

    def __len__(self) -> int:
        return len(self.direction)

    def rows(self, idx: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        src = [self.src[self.src_off[i] : self.src_off[i + 1]].tolist() for i in idx]
        tgt = [self.tgt[self.tgt_off[i] : self.tgt_off[i + 1]].tolist() for i in idx]
        return src, tgt


class StreamSampler:
    """Seeded, resumable global batches from a chunk source (`trainer.data.workers`).

    Args:
        spec: the stream's definition (corpus, directions, seed, sampling).
        source: `InlineChunks` or `WorkerChunks` over `spec`.
        layout: the batch layout of this mesh.
        pad_id, decoder_start_id: for `collate`.
        expected: per direction name, its expected share (p_d; estimated from shard sizes when
            proportional).
        log_notes: log the shards' skipped lines (the rank that logs).
    """

    def __init__(self, spec: StreamSpec, source: Any, layout: BatchLayout, pad_id: int,
                 decoder_start_id: int, expected: dict[str, float], log_notes: bool = True) -> None:  # fmt: skip
        self.spec, self.source, self.layout = spec, source, layout
        self.pad_id, self.decoder_start_id = pad_id, decoder_start_id
        self.seed = spec.seed
        self.directions = [direction_name(d) for d in spec.directions]
        self.probabilities = dict(expected)
        self.log_notes = log_notes
        longest = max(spec.max_source_length, spec.max_target_length)
        r, self.window_size = stream_geometry(layout, longest, len(spec.lanes()))
        if r != spec.chunk_records:
            raise ValueError(f"spec.chunk_records={spec.chunk_records} but this layout's stream takes {r}")
        self.drawn = np.zeros(len(self.directions), np.int64)
        self.skipped: dict[str, int] = dict.fromkeys((*SKIP_KEYS, "dropped_tail"), 0)
        self.step = 0
        self.epoch, self.window_index = 0, -1  # of the window being served
        self._window: Window | None = None
        self._batches: list[list[np.ndarray]] = []
        self._served = 0
        # the chunk the next window starts in: (chunk or None, offset, snapshot before it, counts before it)
        self._pending: Chunk | None = None
        self._pending_off = 0
        self._pending_snap = source.snapshot()
        self._pending_counts = dict(self.skipped)
        self._start: tuple[Snapshot, int, dict[str, int]] = (self._pending_snap.copy(), 0, dict(self.skipped))
        self._epoch_next = 0  # the epoch the next window belongs to

    # ------------------------------------------------------------------ windows
    def _take_chunk(self) -> Chunk | None:
        """The next chunk (counted and its notes logged), or None at a proportional epoch's end."""
        self._pending_snap, self._pending_counts = self.source.snapshot(), dict(self.skipped)
        chunk = self.source.next_chunk()
        if chunk is not None:
            merge_counts(self.skipped, chunk.counts)
            for note in chunk.notes:
                if self.log_notes:
                    logger.warning("data: %s", note)
        return chunk

    def _fill(self) -> tuple[list[tuple[Chunk, int, int]], bool]:
        """Up to W examples from the pending chunk on; True when the epoch ended inside."""
        parts: list[tuple[Chunk, int, int]] = []
        n = 0
        while n < self.window_size:
            if self._pending is None:
                skip = self._pending_off  # a resumed window starts inside its first chunk
                self._pending = self._take_chunk()
                self._pending_off = skip if self._pending is not None else 0
                if self._pending is None:
                    return parts, True
            chunk, off = self._pending, self._pending_off
            take = min(self.window_size - n, len(chunk) - off)
            if take:
                parts.append((chunk, off, off + take))
            n += take
            if off + take >= len(chunk):
                self._pending, self._pending_off = None, 0
            else:
                self._pending_off = off + take
        return parts, False

    def _next_window(self) -> None:
        for _ in range(2):  # an epoch that ends exactly at a window boundary yields one empty window
            if self._pending is None:
                start = (self.source.snapshot(), self._pending_off, dict(self.skipped))
            else:
                start = (self._pending_snap.copy(), self._pending_off, dict(self._pending_counts))
            epoch, index = self._epoch_next, (self.window_index + 1 if self._epoch_next == self.epoch else 0)
            parts, ended = self._fill()
            window = Window(parts)
            batches = self._cut(window, epoch, index, ended)
            self._start, self.epoch, self.window_index = start, epoch, index
            self._window, self._batches, self._served = window, batches, 0
            if ended:
                self._epoch_next = epoch + 1
            if batches:
                return
        raise DataError(
            f"the training stream yields no complete global batch in an epoch ({self.layout.signature()}; "
            f"skipped so far: { {k: v for k, v in self.skipped.items() if v} })"
        )

    def _cut(self, window: Window, epoch: int, index: int, ended: bool) -> list[list[np.ndarray]]:
        rng = np.random.default_rng([self.seed, epoch, index])
        lengths = np.maximum(window.src_len, window.tgt_len)
        cap = self.layout.max_tokens_per_microbatch
        if len(lengths):
            self.layout.check_longest(int(lengths.max()))
        order = rng.permutation(len(window))
        order = order[np.argsort(lengths[order], kind="stable")]
        if cap:
            batches = _token_slots(order, lengths, self.layout, complete_last=True)
        else:
            batches = _sentence_slots(order, lengths, self.layout)
        used = sum(len(s) for b in batches for s in b)
        self.skipped["dropped_tail"] += len(window) - used
        if ended and len(window) > used:
            logger.info("data: epoch %d ends with %d example(s) short of a global batch (dropped)",
                        epoch, len(window) - used)  # fmt: skip
        return [batches[i] for i in rng.permutation(len(batches))]

    # ------------------------------------------------------------------ the sampler interface
    def __iter__(self) -> StreamSampler:
        return self

    def __next__(self) -> GlobalBatch:
        batch = self.peek()
        self.drawn += np.bincount(self._window.direction[np.concatenate(batch.slots)],  # type: ignore[union-attr]
                                  minlength=len(self.directions))  # fmt: skip
        self._served += 1
        self.step += 1
        return batch

    def peek(self) -> GlobalBatch:
        """The next global batch, without moving on."""
        if self._window is None or self._served >= len(self._batches):
            self._next_window()
        window, slots = self._window, self._batches[self._served]
        assert window is not None
        src_len, tgt_len = window.src_len, window.tgt_len
        num_tokens = int(sum(int(tgt_len[s].sum()) for s in slots))
        num_src = int(sum(int(src_len[s].sum()) for s in slots))
        return GlobalBatch(self.step, self.epoch, slots, num_tokens, num_src, self.layout,
                           self._fetcher(window), src_len, tgt_len,
                           padded_positions(slots, src_len, tgt_len, self.layout.pad_to_multiple_of))  # fmt: skip

    def _fetcher(self, window: Window):  # -> Callable[[np.ndarray], Seq2SeqBatch]
        def fetch(indices: np.ndarray) -> Seq2SeqBatch:
            src, tgt = window.rows(indices)
            return collate(src, tgt, self.pad_id, self.decoder_start_id, self.layout.pad_to_multiple_of)

        return fetch

    def shares(self) -> dict[str, dict[str, float]]:
        return served_shares(self.directions, self.probabilities, self.drawn)

    def shares_since(self, mark: np.ndarray) -> dict[str, float]:
        return window_shares(self.directions, self.drawn, mark)

    # ------------------------------------------------------------------ state
    def _identity(self) -> dict[str, Any]:
        spec = self.spec
        return {"seed": self.seed, "corpus": fingerprint(spec.shards), **self.layout.signature(),
                "streaming": {"lanes": len(spec.lanes()), "pieces": len(spec.pieces),
                              "chunk_records": spec.chunk_records, "window_examples": self.window_size,
                              "probabilities": [round(p, 9) for p in spec.probabilities or []],
                              "lengths": [spec.max_source_length, spec.max_target_length, spec.skip_long]}}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Where the current window starts (snapshot, offset), how much of it was served (JSON)."""
        snap, offset, counts = self._start
        return {"epoch": self.epoch, "window_index": self.window_index, "window": snap.to_dict(),
                "window_offset": offset, "served": self._served, "step": self.step,
                "drawn": {n: int(c) for n, c in zip(self.directions, self.drawn)},
                "skipped_at_window": counts, "skipped": dict(self.skipped), **self._identity()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was saved (the same corpus, seed, batch and sampling).

        Raises:
            DataError: the state is another run's (corpus, seed, global batch, sampling or lengths).
        """
        mine = self._identity()
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine or "window" not in state:
            raise DataError(f"data state from a different run: saved {theirs}, this run {mine}")
        snap = Snapshot.from_dict(state["window"])
        self.source.restart(snap)
        self.skipped = {**dict.fromkeys(self.skipped, 0), **state["skipped_at_window"]}
        self._pending, self._pending_off, self._pending_snap = None, int(state["window_offset"]), snap
        self._pending_counts = dict(self.skipped)
        self._epoch_next, self.epoch = int(state["epoch"]), int(state["epoch"])
        self.window_index = int(state["window_index"]) - 1
        self._window = None
        self._next_window()
        self._served, self.step = int(state["served"]), int(state["step"])
        self.drawn = np.array([int(state["drawn"].get(n, 0)) for n in self.directions], np.int64)

    def close(self) -> None:
        self.source.close()
