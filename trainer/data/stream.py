"""The canonical stream of tokenized chunks over a sharded corpus: the same on every rank and for
any number of worker processes, resumable from a small JSON snapshot.

Legend: D directions, L_d lanes of direction d, R records per chunk (`StreamSpec.chunk_records`),
p_d direction d's share.

    lanes      direction d's pieces (those of shards holding both its languages) are permuted
               per epoch (seed, d, epoch) and dealt to its L_d lanes: lane j reads pieces j,
               j + L_d, ... in that order, R records per chunk, one pair per record
    schedule   each turn goes to the direction furthest behind its share,
               argmax_d p_d (n + 1) - n_d (n_d turns of d so far, n their sum; ties: the lower
               d), and within d to its lanes in rotation (lane n_d mod L_d). A turn whose lane
               has ended is skipped, so the schedule is a pure function of the p_d and every
               process computes it without knowing which lanes of other processes have ended.

    proportional (T=1 without weights, or one direction): p_d = the estimated n_d / N, lanes
               end with their pieces, and the epoch ends when every lane has: every pair of the
               corpus once per epoch.
    sampled (temperature / weights): p_d from `trainer.data.sampling`; a lane that ends starts
               its direction's next epoch (a new permutation), so nothing ends.

           d=en-de  lane 0: p7 p2 ..   lane 1: p4 p0 ..      turns: en-de/0 de-en/0 en-de/1 ...
           d=de-en  lane 0: p3 ..      ...

A chunk is tokenized where it is read (`encode_pairs`), into flat int32 arrays. `ChunkReader`
produces the chunks of the lanes it owns in the stream's order (the training process owns every
lane when `dataloader_num_workers` is 0; worker w owns lanes c with c % W == w), so the stream
does not depend on W. `Snapshot` is the schedule plus each lane's position: a checkpoint holds the
snapshot before the chunk where the current window of examples starts.

No torch here: worker processes import this module.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from trainer.data.shards import Piece, PieceReader, Shard
from trainer.errors import DataError

LANES = 64  # lanes over all directions (at least one per direction): pieces read side by side
LANES_PER_DIRECTION = 8  # at most, for a direction with that many pieces
CHUNK_RECORDS = 128  # records per chunk, at most (`StreamSpec.chunk_records`)
MIN_CHUNK_RECORDS = 16
MAX_OPEN_READERS = 256  # open pieces per process (least recently used closed first)
SKIP_KEYS = ("unreadable_line", "missing_side", "empty_text", "source_too_long", "target_too_long",
             "truncated_source", "truncated_target")  # fmt: skip


@dataclass(frozen=True)
class StreamSpec:
    """What the stream is a function of (with the snapshot): the corpus, directions, seed, shares,
    lengths. Picklable."""

    shards: tuple[Shard, ...]
    pieces: tuple[Piece, ...]
    directions: tuple[tuple[str, str], ...]
    seed: int
    max_bad: float
    max_source_length: int
    max_target_length: int
    skip_long: bool
    probabilities: tuple[float, ...]  # p_d per direction
    endless: bool = False  # sampled: lanes start their next epoch instead of ending
    chunk_records: int = CHUNK_RECORDS  # R (`trainer.data.stream_sampler.stream_geometry`)

    @cached_property
    def direction_pieces(self) -> tuple[tuple[int, ...], ...]:
        """Per direction, the pieces of the shards that hold both its languages."""
        out = []
        for s, t in self.directions:
            out.append(tuple(i for i, p in enumerate(self.pieces)
                             if s in self.shards[p.shard].languages and t in self.shards[p.shard].languages))  # fmt: skip
        return tuple(out)

    @cached_property
    def lane_counts(self) -> tuple[int, ...]:
        """L_d: up to `LANES_PER_DIRECTION`, sharing `LANES` over the directions, at most its pieces."""
        share = max(1, LANES // max(1, len(self.directions)))
        return tuple(max(1, min(LANES_PER_DIRECTION, share, len(p))) for p in self.direction_pieces)

    @cached_property
    def lane_offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.lane_counts)[:-1]]))

    def lanes(self) -> list[int]:
        return list(range(sum(self.lane_counts)))

    def first_direction(self, piece_index: int) -> int:
        """The lowest direction a piece serves: the one that counts its unreadable lines."""
        return next(d for d, pieces in enumerate(self.direction_pieces) if piece_index in pieces)

    def lane_direction(self, lane: int) -> tuple[int, int]:
        """(direction d, lane j of d) of a lane id."""
        d = int(np.searchsorted(self.lane_offsets, lane, side="right")) - 1
        return d, lane - self.lane_offsets[d]

    def lane_pieces(self, lane: int, epoch: int) -> list[int]:
        """The pieces lane `lane` reads in `epoch` of its direction, in order."""
        d, j = self.lane_direction(lane)
        mine = self.direction_pieces[d]
        order = np.random.default_rng([self.seed, d, epoch]).permutation(len(mine))
        return [mine[i] for i in order[j :: self.lane_counts[d]]]


@dataclass
class Snapshot:
    """The stream's position: turns per direction, ended lanes, each lane's [epoch, piece k, position]."""

    epoch: int = 0  # proportional: the corpus epoch (sampled: 0; each lane keeps its own)
    drawn: list[int] = field(default_factory=list)  # turns per direction this epoch
    done: list[int] = field(default_factory=list)  # proportional: lanes that ended this epoch
    lanes: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def start(cls, spec: StreamSpec, epoch: int = 0) -> Snapshot:
        return cls(epoch, [0] * len(spec.directions), [], {lane: [epoch, 0, 0] for lane in spec.lanes()})

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "drawn": list(self.drawn), "done": sorted(self.done),
                "lanes": {str(k): list(v) for k, v in self.lanes.items()}}  # fmt: skip

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> Snapshot:
        lanes = {int(k): [int(x) for x in v] for k, v in state["lanes"].items()}
        return cls(
            int(state["epoch"]), [int(x) for x in state["drawn"]], [int(x) for x in state["done"]], lanes
        )

    def copy(self) -> Snapshot:
        return copy.deepcopy(self)

    def over(self, spec: StreamSpec) -> bool:
        return len(self.done) >= len(spec.lanes())

    def next_lane(self, spec: StreamSpec, known_done: bool = True) -> int | None:
        """Take the schedule's next turn and return its lane; None when the epoch is over.

        `known_done`: skip turns of ended lanes (this process knows them all); False for a process
        that only learns its own lanes' ends (the caller skips the lanes it does not own).
        """
        probs = np.asarray(spec.probabilities)
        while not self.over(spec):
            drawn = np.asarray(self.drawn)
            d = int(np.argmax(probs * (drawn.sum() + 1) - drawn))
            lane = spec.lane_offsets[d] + self.drawn[d] % spec.lane_counts[d]
            self.drawn[d] += 1
            if known_done and lane in self.done:
                continue
            return lane
        return None

    def advance(self, lane: int, lane_state: list[int], done: bool) -> None:
        """Record that `lane` produced its next chunk, leaving it at `lane_state` (`done`: it ended)."""
        self.lanes[lane] = list(lane_state)
        if done and lane not in self.done:
            self.done.append(lane)


@dataclass
class Chunk:
    """One chunk's examples, tokenized: flat int32 ids with offsets, and what was skipped."""

    lane: int
    lane_state: list[int]  # the lane's [epoch, piece k, position] after this chunk
    done: bool  # proportional: the lane has no record left this epoch
    src: np.ndarray  # int32, all sources' ids end to end
    src_off: np.ndarray  # int64 (n + 1,)
    tgt: np.ndarray
    tgt_off: np.ndarray
    direction: np.ndarray  # int16 (n,): index into the run's directions
    records: int  # raw records read
    counts: dict[str, int]  # SKIP_KEYS
    notes: list[str] = field(default_factory=list)  # bad lines to log, named by shard and line

    def __len__(self) -> int:
        return len(self.direction)


def _add_pair(record: dict[str, Any], d: int, direction: tuple[str, str],
              pairs: tuple[list[str], list[str], list[str], list[str], list[int]],
              counts: dict[str, int]) -> None:  # fmt: skip
    """Append the record's pair for direction d, or count why it has none."""
    s, t = record.get(direction[0]), record.get(direction[1])
    if not isinstance(s, str) or not isinstance(t, str):
        counts["missing_side"] += 1
    elif not s.strip() or not t.strip():
        counts["empty_text"] += 1
    else:
        for column, value in zip(pairs, (direction[0], direction[1], s, t, d)):
            column.append(value)  # type: ignore[attr-defined]


def _flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sequences -> (ids end to end, offsets), iterated in C (`chain`), not in a generator."""
    lengths = np.fromiter(map(len, seqs), np.int64, len(seqs))
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(seqs), np.int32, int(offsets[-1]))
    return flat, offsets


class ChunkReader:
    """Reads and tokenizes the chunks of the lanes it owns, in the stream's order, from a snapshot.

    Open pieces are kept between chunks (at most `MAX_OPEN_READERS`, least recently used closed
    first; a closed gzip piece is re-read to its position when its lane comes back).
    """

    def __init__(self, spec: StreamSpec, tokenizer: Any, snapshot: Snapshot, owned: set[int] | None = None):
        self.spec, self.tok, self.snap = spec, tokenizer, snapshot.copy()
        self.owned = set(spec.lanes()) if owned is None else owned
        self._readers: OrderedDict[int, tuple[tuple[int, int, int], PieceReader, Any]] = OrderedDict()
        self._usable: dict[int, int] = {}  # sampled: the lane epoch of each lane's last usable pair

    def next_chunk(self) -> Chunk | None:
        """The next chunk of an owned lane, in stream order; None when every owned lane has ended this
        epoch (proportional: the next call starts the next epoch)."""
        spec = self.spec
        while True:
            if all(lane in self.snap.done for lane in self.owned):
                self.snap = Snapshot.start(spec, self.snap.epoch + 1)
                return None
            lane = self.snap.next_lane(spec, known_done=False)
            if lane is None or lane not in self.owned or lane in self.snap.done:
                continue  # another process's lane, or an ended one: the turn passes
            chunk = self.read(lane)
            self.snap.advance(lane, chunk.lane_state, chunk.done)
            return chunk

    def read(self, lane: int) -> Chunk:
        """Read R records of `lane` from its position and tokenize their pairs."""
        spec = self.spec
        d = spec.lane_direction(lane)[0]
        epoch, k, pos = self.snap.lanes[lane]
        pieces = spec.lane_pieces(lane, epoch)
        pairs: tuple[list[str], list[str], list[str], list[str], list[int]] = ([], [], [], [], [])
        counts = dict.fromkeys(SKIP_KEYS, 0)
        notes: list[str] = []
        records, done = 0, False
        while records < spec.chunk_records:
            if k >= len(pieces):
                if not spec.endless:
                    done = True
                    break
                epoch, k, pieces = epoch + 1, 0, spec.lane_pieces(lane, epoch + 1)
                if epoch - self._usable.setdefault(lane, epoch - 1) >= 2 and not pairs[4]:
                    name = "-".join(spec.directions[d])  # a whole pass without a pair: never loop for ever
                    raise DataError(f"direction {name}: its shards hold no usable pair (every record "
                                    "lacks a side or is empty)")  # fmt: skip
                continue
            reader, it = self._reader(lane, epoch, k, pieces[k], pos)
            for record in it:
                records += 1
                _add_pair(record, d, spec.directions[d], pairs, counts)
                if records >= spec.chunk_records:
                    break
            else:  # the piece ended
                bad = reader.finish()
                if bad.bad and d == spec.first_direction(pieces[k]):  # counted once, not per direction
                    counts["unreadable_line"] += bad.bad
                    notes.append(f"shard {bad.path!r}: skipped {bad.bad} unreadable line(s) of {bad.lines} "
                                 f"({'; '.join(bad.examples)})")  # fmt: skip
                self._readers.pop(lane, None)
                k, pos = k + 1, 0
                continue
            pos = reader.position()
            self._readers[lane] = ((epoch, k, pos), reader, it)
        if pairs[4]:
            self._usable[lane] = epoch
        return self._tokenize(lane, [epoch, k, pos], done, records, pairs, counts, notes)

    def _reader(self, lane: int, epoch: int, k: int, piece_index: int, pos: int) -> tuple[PieceReader, Any]:
        """The lane's open reader when it stands at (epoch, k, pos), else a new one opened there."""
        held = self._readers.pop(lane, None)
        if held is not None and held[0] == (epoch, k, pos):
            self._readers[lane] = held
            return held[1], held[2]
        piece = self.spec.pieces[piece_index]
        reader = PieceReader(self.spec.shards[piece.shard], piece, self.spec.max_bad, pos)
        it = iter(reader)
        self._readers[lane] = ((epoch, k, pos), reader, it)
        while len(self._readers) > MAX_OPEN_READERS:
            _, (_, _, old) = self._readers.popitem(last=False)
            old.close()
        return reader, it

    def _tokenize(self, lane: int, state: list[int], done: bool, records: int,
                  pairs: tuple[list[str], list[str], list[str], list[str], list[int]],
                  counts: dict[str, int], notes: list[str]) -> Chunk:  # fmt: skip
        from trainer.data.tokenization import encode_pairs

        spec = self.spec
        src_langs, tgt_langs, sources, targets, dirs = pairs
        ids, labels, skip, cut = encode_pairs(
            self.tok, src_langs, tgt_langs, sources, targets,
            spec.max_source_length, spec.max_target_length, spec.skip_long,
        )  # fmt: skip
        keep = [i for i, code in enumerate(skip) if code == 0]
        counts["source_too_long"] += sum(1 for c in skip if c == 3)
        counts["target_too_long"] += sum(1 for c in skip if c == 4)
        counts["truncated_source"] += sum(1 for c in cut if c & 1)
        counts["truncated_target"] += sum(1 for c in cut if c & 2)
        src, src_off = _flat([ids[i] for i in keep])
        tgt, tgt_off = _flat([labels[i] for i in keep])
        direction = np.asarray([dirs[i] for i in keep], np.int16)
        return Chunk(lane, state, done, src, src_off, tgt, tgt_off, direction, records, counts, notes)

    def close(self) -> None:
        for _, _, it in self._readers.values():
            it.close()
        self._readers.clear()


def owned_lanes(spec: StreamSpec, worker: int, num_workers: int) -> set[int]:
    """The lanes worker `worker` of `num_workers` reads."""
    return {lane for lane in spec.lanes() if lane % num_workers == worker}


def merge_counts(total: dict[str, int], add: dict[str, int]) -> None:
    """Add a chunk's skip counts to the running ones."""
    for key, value in add.items():
        total[key] = total.get(key, 0) + int(value)
