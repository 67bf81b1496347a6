"""Tokenized pairs -> mesh-independent global batches, and evaluation batches.

    GlobalBatchSampler  -> GlobalBatch k (depends on data, seed, global batch size and the
                        direction sampling of `trainer.data.sampling` only; holds lengths, not rows)
    GlobalBatch.shard   -> one dp replica's share: gas x m `Seq2SeqBatch`es
    eval_batches        -> per-direction batches with reference strings for BLEU

The legend and the cut into slots: `trainer.data.sources`' docstring.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models.m2m100 import IGNORE_INDEX, Seq2SeqBatch
from trainer.data.sampling import (
    DirectionSampling,
    SamplingError,
    direction_probabilities,
    draw_epoch,
    epoch_counts,
    served_shares,
    window_shares,
)
from trainer.data.sources import column_array
from trainer.data.tokenization import TranslationData
from trainer.errors import DataError
from trainer.tokenizer.vocab import Tokenizer

CHUNK_GLOBAL_BATCHES = 64  # a length-sorting chunk holds this many global batches


def bucket(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple` (`pad_to_multiple_of`; 1: unchanged)."""
    return -(-length // multiple) * multiple


def collate(input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], pad_id: int,
            decoder_start_id: int, pad_to_multiple_of: int = 1) -> Seq2SeqBatch:  # fmt: skip
    """Right-pad examples into a `Seq2SeqBatch` trimmed to its own longest source / target, rounded
    up to a multiple of `pad_to_multiple_of` (HF `DataCollatorForSeq2Seq`'s name): lengths fall in
    buckets, so compiled stages meet a bounded set of shapes. Pads are masked keys and ignored
    labels, so the loss does not change.

    decoder_input_ids = [decoder_start] + labels[:-1]  (M2M100: `</s> __tgt__ y`).
    """
    b = len(input_ids)
    s_len = bucket(max(len(x) for x in input_ids), pad_to_multiple_of)
    t_len = bucket(max(len(y) for y in labels), pad_to_multiple_of)
    src = torch.full((b, s_len), pad_id, dtype=torch.long)  # (B, S)
    mask = torch.zeros((b, s_len), dtype=torch.long)
    lab = torch.full((b, t_len), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    dec = torch.full((b, t_len), pad_id, dtype=torch.long)
    for i, (x, y) in enumerate(zip(input_ids, labels)):
        src[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
        lab[i, : len(y)] = torch.tensor(y)
        dec[i, : len(y)] = torch.tensor([decoder_start_id, *y[:-1]])
    return Seq2SeqBatch(src, mask, dec, lab, tuple(map(len, input_ids)), tuple(map(len, labels)))


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch is cut: K = m * g * dp slots of B pairs (or <= T padded tokens), each
    padded to lengths that are multiples of `pad_to_multiple_of` (in token mode the cap counts
    the padded lengths, so which examples share a slot depends on it)."""

    per_device_batch_size: int
    num_microbatches: int = 1
    gradient_accumulation_steps: int = 1
    dp_size: int = 1
    max_tokens_per_microbatch: int | None = None
    pad_to_multiple_of: int = 1

    def __post_init__(self) -> None:
        names = ("per_device_batch_size", "num_microbatches", "gradient_accumulation_steps", "dp_size",
                 "pad_to_multiple_of")  # fmt: skip
        for name in names:
            if getattr(self, name) < 1:
                raise DataError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise DataError(
                f"max_tokens_per_microbatch={self.max_tokens_per_microbatch} must be >= 1 or unset"
            )

    @property
    def num_slots(self) -> int:
        """K: micro-batches in one global batch, over all replicas and flushes."""
        return self.num_microbatches * self.gradient_accumulation_steps * self.dp_size

    @property
    def global_batch_size(self) -> int | None:
        """G = B * K pairs, or None in token mode (the pair count varies)."""
        return None if self.max_tokens_per_microbatch else self.per_device_batch_size * self.num_slots

    def signature(self) -> dict[str, int]:
        """What the global batch sequence depends on (besides data and seed)."""
        if self.max_tokens_per_microbatch:
            pad = {"pad_to_multiple_of": self.pad_to_multiple_of} if self.pad_to_multiple_of > 1 else {}
            return {"max_tokens_per_microbatch": self.max_tokens_per_microbatch, "num_slots": self.num_slots,
                    **pad}  # fmt: skip
        return {"global_batch_size": int(self.per_device_batch_size * self.num_slots)}

    def check_longest(self, longest: int) -> None:
        """Raises: DataError: the token cap is below the longest example's padded length."""
        cap, pad = self.max_tokens_per_microbatch, self.pad_to_multiple_of
        if cap and bucket(longest, pad) > cap:
            padded = (
                f", {bucket(longest, pad)} padded to a multiple of pad_to_multiple_of={pad}"
                if pad > 1
                else ""
            )
            raise DataError(
                f"max_tokens_per_microbatch={cap} is below the longest example ({longest} tokens{padded}); "
                "raise it or lower max_source_length/max_target_length"
            )

    def slot(self, dp_rank: int, flush: int, micro: int) -> int:
        """The slot of (replica, flush, micro-batch): replicas interleave over the length order,
        so each gets a similar mix of short and long slots."""
        return (flush * self.num_microbatches + micro) * self.dp_size + dp_rank


@dataclass
class GlobalBatch:
    """One optimizer step's examples: K slots of example indices into the training set."""

    step: int
    epoch: int
    slots: list[np.ndarray]
    num_tokens: int  # target tokens with a loss in the whole global batch (the loss normaliser)
    num_src_tokens: int  # source tokens in the whole global batch
    layout: BatchLayout
    fetch: Callable[[np.ndarray], Seq2SeqBatch] = field(repr=False)
    src_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)  # by example index
    tgt_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    padded_tokens: int = 0  # source + target positions of the padded micro-batches (padding share)

    def example_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) token counts of every example of the global batch (host arrays)."""
        idx = np.concatenate(self.slots)
        return self.src_len[idx], self.tgt_len[idx]

    @property
    def padding_fraction(self) -> float:
        """The share of the micro-batches' positions that are padding (source and target together)."""
        real = self.num_tokens + self.num_src_tokens
        return 1.0 - real / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def num_examples(self) -> int:
        return int(sum(len(s) for s in self.slots))

    def example_indices(self) -> list[int]:
        """All example indices of the global batch, sorted."""
        return sorted(int(i) for s in self.slots for i in s)

    def slot_ids(self, dp_rank: int) -> list[list[int]]:
        """Replica `dp_rank`'s slot numbers as [flush][micro-batch]: where each of its micro-batches
        sits in the global batch (what keys its dropout masks: `parallel.rng.microbatch_keys`)."""
        lay = self.layout
        if not 0 <= dp_rank < lay.dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, {lay.dp_size})")
        return [
            [lay.slot(dp_rank, g, j) for j in range(lay.num_microbatches)]
            for g in range(lay.gradient_accumulation_steps)
        ]

    def replica_slots(self, dp_rank: int) -> list[list[np.ndarray]]:
        """Replica `dp_rank`'s slots as [flush][micro-batch] index arrays."""
        return [[self.slots[k] for k in flush] for flush in self.slot_ids(dp_rank)]

    def shard(self, dp_rank: int) -> list[list[Seq2SeqBatch]]:
        """Replica `dp_rank`'s share: `gradient_accumulation_steps` lists of
        `num_microbatches` padded batches, each trimmed to its own longest sequence and
        carrying its slot (`BatchLayout.slot`: keys MoE routing randomness)."""
        lay = self.layout
        out = [[self.fetch(idx) for idx in flush] for flush in self.replica_slots(dp_rank)]
        for g, flush in enumerate(out):
            for j, batch in enumerate(flush):
                batch.slot = lay.slot(dp_rank, g, j)
        return out


def direction_ids(ds: Any) -> tuple[list[str], np.ndarray]:
    """(direction names sorted, each example's index into them), computed column-wise in Arrow."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = ds.with_format("arrow").select_columns(["src_lang", "tgt_lang"])[:]
    joined = pc.binary_join_element_wise(table["src_lang"], table["tgt_lang"], "-")
    if isinstance(joined, pa.ChunkedArray):
        joined = joined.combine_chunks()
    names = sorted(pc.unique(joined).to_pylist())
    codes = pc.index_in(joined, value_set=pa.array(names, pa.string()))
    return names, np.asarray(codes.to_numpy(zero_copy_only=False), dtype=np.int64)


def padded_positions(slots: Sequence[np.ndarray], src_len: np.ndarray, tgt_len: np.ndarray,
                     multiple: int = 1) -> int:  # fmt: skip
    """Source + target positions of the slots' micro-batches, each padded to its own longest
    rounded up to `multiple` (`collate`'s shapes)."""
    return int(sum(len(s) * (bucket(int(src_len[s].max()), multiple) + bucket(int(tgt_len[s].max()), multiple))
                   for s in slots if len(s)))  # fmt: skip


def _sentence_slots(order: np.ndarray, lengths: np.ndarray, layout: BatchLayout) -> list[list[np.ndarray]]:
    g, b = layout.per_device_batch_size * layout.num_slots, layout.per_device_batch_size
    batches = []
    for start in range(0, len(order) - g + 1, g):
        members = order[start : start + g]
        members = members[np.argsort(lengths[members], kind="stable")]
        batches.append([members[k * b : (k + 1) * b] for k in range(layout.num_slots)])
    return batches


def _token_slots(
    order: np.ndarray, lengths: np.ndarray, layout: BatchLayout, complete_last: bool = False
) -> list[list[np.ndarray]]:
    """Greedy token-capped slots in `order`, K to a global batch (the cap counts padded lengths:
    `pad_to_multiple_of`). The trailing partial global batch is dropped, or with `complete_last`
    (a stream's window) made whole by halving its fullest slots while it has at least K examples
    (a halved slot stays under the cap)."""
    cap, k, pad = layout.max_tokens_per_microbatch or 0, layout.num_slots, layout.pad_to_multiple_of
    batches: list[list[np.ndarray]] = []
    slots: list[np.ndarray] = []
    start, longest = 0, 0
    for pos, length in enumerate(lengths[order].tolist()):
        if pos > start and (pos - start + 1) * bucket(max(longest, length), pad) > cap:
            slots.append(order[start:pos])
            start, longest = pos, 0
            if len(slots) == k:
                batches.append(slots)
                slots = []
        longest = max(longest, length)
    if complete_last:
        rest = [*slots, order[start:]] if start < len(order) else slots
        while rest and len(rest) < k and max(len(s) for s in rest) > 1:
            i = max(range(len(rest)), key=lambda j: len(rest[j]))
            half = len(rest[i]) // 2
            rest[i : i + 1] = [rest[i][:half], rest[i][half:]]
        if len(rest) == k:
            batches.append(rest)
    return batches


class FixedBatch:
    """One fixed list of micro-batches read through the `GlobalBatch` interface that
    `trainer.run.step.train_step` uses (one replica, one flush): what the planner's measurements
    and the step benchmarks drive the real step with."""

    def __init__(self, microbatches: Sequence[Seq2SeqBatch]) -> None:
        self.microbatches = list(microbatches)
        self.num_tokens = sum(b.num_tokens() for b in self.microbatches)
        self.num_src_tokens = sum(b.num_src_tokens() for b in self.microbatches)

    def shard(self, dp_rank: int) -> list[list[Seq2SeqBatch]]:
        return [self.microbatches]

    def slot_ids(self, dp_rank: int) -> list[list[int]]:
        return [list(range(len(self.microbatches)))]


class GlobalBatchSampler:
    """Length-bucketed, seeded, resumable sequence of global batches over epochs.

    Per epoch: shuffle all examples (seed, epoch) -- or, with temperature / weighted sampling
    across directions (`trainer.data.sampling`), draw N examples by direction and shuffle them; cut into chunks of
    `CHUNK_GLOBAL_BATCHES` global batches; sort each chunk by length; cut into global
    batches (dropping the last partial one); shuffle the order of global batches.
    `state_dict()` holds (epoch, position): a restored sampler continues exactly.
    """

    def __init__(
        self,
        train: Any,
        layout: BatchLayout,
        seed: int,
        pad_id: int,
        decoder_start_id: int,
        sampling: DirectionSampling | None = None,
    ) -> None:
        """
        Args:
            train: tokenized training examples (`tokenize_datasets(...).train`); only the length
                and direction columns are read into memory (numpy), rows are fetched per batch.
            layout: the batch layout of this mesh.
            seed: data-order seed.
            pad_id, decoder_start_id: `Tokenizer.pad_id` and `special_ids()["decoder_start_token_id"]`.
            sampling: temperature / weights across directions (default: proportional, T=1).

        Raises:
            DataError: fewer examples than one global batch, an example longer than the token
                cap, or sampling weights that do not fit the data's directions.
        """
        self.train, self.layout, self.seed = train, layout, seed
        # The fetched columns' view, made once: `select_columns` fingerprints its arguments with dill
        # at each call (1.1 ms, against 0.3 ms for the rows themselves, per micro-batch).
        self._rows = train.select_columns(["input_ids", "labels"])
        self.pad_id, self.decoder_start_id = pad_id, decoder_start_id
        self.src_len, self.tgt_len = column_array(train, "src_len"), column_array(train, "tgt_len")
        self.lengths = np.maximum(self.src_len, self.tgt_len)  # padded cost per row
        self._check_size()
        self.sampling = sampling or DirectionSampling()
        self.directions, self.direction_of = direction_ids(train)
        self._groups = [np.flatnonzero(self.direction_of == d) for d in range(len(self.directions))]
        sizes = {name: len(g) for name, g in zip(self.directions, self._groups)}
        try:
            self.probabilities = direction_probabilities(sizes, self.sampling)
        except SamplingError as e:
            raise DataError(str(e)) from None
        # one direction or T=1 without weights: today's plain shuffle, bit for bit
        self._resample = not self.sampling.proportional and len(self.directions) > 1
        self.drawn = np.zeros(len(self.directions), np.int64)  # examples per direction in batches served
        self.epoch, self.position, self.step = 0, 0, 0
        self._plan: list[list[np.ndarray]] | None = None

    def _check_size(self) -> None:
        n, lay = len(self.lengths), self.layout
        if n:
            lay.check_longest(int(self.lengths.max()))
        need = lay.global_batch_size or lay.num_slots
        if n < need:
            raise DataError(
                f"the training set has {n} examples, fewer than one global batch ({lay.signature()})"
            )

    def _chunk_size(self) -> int:
        g = self.layout.global_batch_size
        if g is None:  # token mode: about as many examples as fill CHUNK_GLOBAL_BATCHES global batches
            budget = (self.layout.max_tokens_per_microbatch or 1) * self.layout.num_slots
            g = max(1, budget // max(1, int(self.lengths.mean())))
        return g * CHUNK_GLOBAL_BATCHES

    def epoch_plan(self, epoch: int) -> list[list[np.ndarray]]:
        """The global batches of `epoch`, each as its K slots (pure function of data, seed, layout)."""
        rng = np.random.default_rng([self.seed, epoch])
        if self._resample:
            counts = epoch_counts(list(self.probabilities.values()), len(self.lengths))
            order = draw_epoch(rng, self._groups, counts)
        else:
            order = rng.permutation(len(self.lengths))
        chunk = self._chunk_size()
        for start in range(0, len(order), chunk):
            piece = order[start : start + chunk]
            order[start : start + chunk] = piece[np.argsort(self.lengths[piece], kind="stable")]
        cut = _token_slots if self.layout.max_tokens_per_microbatch else _sentence_slots
        batches = cut(order, self.lengths, self.layout)
        if not batches:
            raise DataError(f"epoch {epoch} yields no complete global batch ({self.layout.signature()})")
        return [batches[i] for i in rng.permutation(len(batches))]

    def _fetch(self, indices: np.ndarray) -> Seq2SeqBatch:
        rows = self._rows[[int(i) for i in indices]]
        return collate(rows["input_ids"], rows["labels"], self.pad_id, self.decoder_start_id,
                       self.layout.pad_to_multiple_of)  # fmt: skip

    def __iter__(self) -> Iterator[GlobalBatch]:
        return self

    def __next__(self) -> GlobalBatch:
        if self._plan is None:
            self._plan = self.epoch_plan(self.epoch)
        if self.position >= len(self._plan):
            self.epoch, self.position, self._plan = self.epoch + 1, 0, self.epoch_plan(self.epoch + 1)
        slots = self._plan[self.position]
        num_tokens = int(sum(int(self.tgt_len[s].sum()) for s in slots))
        num_src = int(sum(int(self.src_len[s].sum()) for s in slots))
        padded = padded_positions(slots, self.src_len, self.tgt_len, self.layout.pad_to_multiple_of)
        batch = GlobalBatch(self.step, self.epoch, slots, num_tokens, num_src, self.layout, self._fetch,
                            self.src_len, self.tgt_len, padded)  # fmt: skip
        self.drawn += np.bincount(self.direction_of[np.concatenate(slots)], minlength=len(self.directions))
        self.position += 1
        self.step += 1
        return batch

    def peek(self) -> GlobalBatch:
        """The next global batch, without moving on (a copy of the sampler draws it)."""
        return next(copy.deepcopy(self))

    def close(self) -> None:
        """Nothing to release (the streaming sampler stops its workers)."""

    def shares(self) -> dict[str, dict[str, float]]:
        """`trainer.data.sampling.served_shares` of the examples served so far."""
        return served_shares(self.directions, self.probabilities, self.drawn)

    def shares_since(self, mark: np.ndarray) -> dict[str, float]:
        """`trainer.data.sampling.window_shares` since `mark` (an earlier copy of `drawn`)."""
        return window_shares(self.directions, self.drawn, mark)

    def _identity(self) -> dict[str, Any]:
        return {"seed": self.seed, "num_examples": len(self.lengths), **self.layout.signature(),
                **self.sampling.signature()}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from, and the examples drawn per direction (JSON-serialisable)."""
        drawn = {name: int(n) for name, n in zip(self.directions, self.drawn)}
        return {"epoch": self.epoch, "position": self.position, "step": self.step, "drawn": drawn,
                **self._identity()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the global batch sequence must be the same one.

        Raises:
            DataError: if the data size, seed, global batch or direction sampling differ from the saved state's.
        """
        mine = self._identity()
        keys = set(mine) | {"sampling_temperature", "sampling_weights"}
        theirs = {k: state[k] for k in keys if k in state}
        if theirs != mine:
            raise DataError(f"data state from a different run: saved {theirs}, this run {mine}")
        self.epoch, self.position, self.step = int(state["epoch"]), int(state["position"]), int(state["step"])
        drawn = state.get("drawn", {})  # absent in states saved before sampling existed
        self.drawn = np.array([int(drawn.get(name, 0)) for name in self.directions], np.int64)
        self._plan = None


@dataclass
class EvalBatch:
    """One evaluation batch of a direction, with the texts BLEU needs."""

    direction: str
    batch: Seq2SeqBatch
    sources: list[str]
    references: list[str]
    forced_bos_token_id: int  # the target language tag: decoding starts `</s> __tgt__`


def eval_batches(data: TranslationData, tokenizer: Tokenizer, batch_size: int) -> dict[str, list[EvalBatch]]:
    """Validation batches per direction, sorted by source length (references stay aligned).

    Args:
        data: the tokenized data.
        tokenizer: the run's tokenizer (pad / decoder start / tag ids).
        batch_size: pairs per batch (`per_device_eval_batch_size`).

    Returns:
        `{direction name: [EvalBatch, ...]}`; a direction without validation pairs maps to [].
    """
    out: dict[str, list[EvalBatch]] = {}
    for name, ds in data.validation.items():
        tgt = name.split("-", 1)[1]
        order = np.argsort(column_array(ds, "src_len"), kind="stable") if len(ds) else np.zeros(0, np.int64)
        batches = []
        for start in range(0, len(order), batch_size):
            rows = ds[[int(i) for i in order[start : start + batch_size]]]
            batch = collate(rows["input_ids"], rows["labels"], tokenizer.pad_id, tokenizer.eos_id)
            batches.append(EvalBatch(name, batch, rows["source"], rows["target"], tokenizer.lang_id(tgt)))
        out[name] = batches
    return out
