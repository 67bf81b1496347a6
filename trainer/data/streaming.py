"""A streaming run's training data: the corpus as shards, its stream, and a bounded tokenizer sample.

    open_corpus       train_file (or dataset_name's data files) -> shards probed, cut into pieces,
                      the run's directions mapped to the shards that hold them (an error before
                      step 1 for a missing / empty shard or a direction no shard holds)
    stream_spec       + seed, lengths, direction sampling -> `StreamSpec` and the expected shares
    sample_texts      a tokenizer sample of `spm_input_sentence_size` sentences drawn across shards
                      and directions at random offsets (seeded): its cost is the sample's, not the
                      corpus's
    build_stream_sampler  -> `StreamSampler` over in-process or worker chunk reading

Every rank does this on its own (each step O(shards), never O(corpus)); nothing here waits on
another rank. The pairs per direction n_d that temperature sampling needs are estimated from the
shards' sizes and their first lines (exact for Parquet), since counting them would read the corpus.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.config.data_args import DataArguments
from trainer.data.batching import BatchLayout
from trainer.data.sampling import DirectionSampling, SamplingError, direction_probabilities
from trainer.data.shards import Piece, PieceReader, Shard, resolve_shards, shard_languages, split_pieces
from trainer.data.sources import direction_name, run_languages
from trainer.data.stream import StreamSpec
from trainer.data.stream_sampler import StreamSampler
from trainer.data.workers import InlineChunks, WorkerChunks
from trainer.errors import DataError

logger = logging.getLogger(__name__)
SAMPLE_RUN = 32  # consecutive records read at each random offset of the tokenizer sample


@dataclass(frozen=True)
class Corpus:
    """The training shards, their pieces, and the estimated pairs per direction (by name)."""

    shards: tuple[Shard, ...]
    pieces: tuple[Piece, ...]
    directions: tuple[tuple[str, str], ...]
    estimated_pairs: dict[str, int]


def train_entries(data_args: DataArguments) -> list[str]:
    """train_file's entries, or the `train` data files of `dataset_name` (a local directory of data
    files, or a name `datasets` resolves to files) for `streaming: true`."""
    if not data_args.dataset_name:
        return data_args.train_files()
    import datasets

    name = data_args.dataset_name
    try:
        builder = datasets.load_dataset_builder(name, data_args.dataset_config_name)
    except Exception as e:  # offline / unknown name
        raise DataError(
            f"dataset_name={name!r} cannot be resolved to data files: {str(e).splitlines()[0]}"
        ) from None
    files = dict(builder.config.data_files or {})
    if "train" not in files:
        raise DataError(f"dataset_name={name!r} has no 'train' data files to stream; it has {sorted(files)}")
    found = [str(f) for f in files["train"]]
    remote = [f for f in found if "://" in f]
    if remote:
        raise DataError(
            f"dataset_name={name!r}: streaming reads local files; {remote[0]!r} is remote (download the "
            "dataset, e.g. with `huggingface-cli download --repo-type dataset`, and name the directory)"
        )
    return found


def open_corpus(data_args: DataArguments) -> Corpus:
    """The run's shards and pieces, checked (see the module docstring).

    Raises:
        DataError: a missing / empty / unreadable shard, or a direction whose languages no shard holds.
    """
    languages = run_languages(data_args)
    what = "train_file" if not data_args.dataset_name else f"dataset {data_args.dataset_name!r}"
    found = resolve_shards(train_entries(data_args), languages, what)
    directions = tuple(data_args.directions())
    shards = [sh for sh in found if any(s in sh.languages and t in sh.languages for s, t in directions)]
    if len(shards) < len(found):
        logger.info("data: %d of %d shard(s) hold no direction of the run; not read", len(found) - len(shards),
                    len(found))  # fmt: skip
    estimated: dict[str, int] = {}
    for s, t in directions:
        holding = [sh for sh in shards if s in sh.languages and t in sh.languages]
        if not holding:
            raise DataError(
                f"{what}: no shard holds both {s!r} and {t!r} (direction {s}-{t}); languages in the "
                f"shards: {shard_languages(found)}"
            )
        estimated[direction_name((s, t))] = sum(sh.records for sh in holding)
    pieces = split_pieces(shards)
    logger.info("data: %d shard(s), %d piece(s), about %s pairs per direction (estimated from sizes)",
                len(shards), len(pieces), estimated)  # fmt: skip
    return Corpus(tuple(shards), tuple(pieces), directions, estimated)


def stream_spec(corpus: Corpus, data_args: DataArguments, seed: int) -> tuple[StreamSpec, dict[str, float]]:
    """The stream's definition and each direction's expected share.

    Proportional sampling (T=1 without weights, or one direction) reads every pair once per epoch;
    its expected shares are the estimated sizes'. Otherwise p_d from the estimated n_d (or the weights).

    Raises:
        DataError: sampling weights that do not fit the run's directions.
    """
    weights = data_args.direction_weights(data_args.sampling_weights)
    sampling = DirectionSampling(data_args.sampling_temperature, weights)
    sizes = dict(corpus.estimated_pairs)
    proportional = sampling.proportional or len(corpus.directions) == 1
    try:
        if proportional:
            total = max(1, sum(sizes.values()))
            expected = {d: n / total for d, n in sizes.items()}
        else:
            expected = direction_probabilities(sizes, sampling)
    except SamplingError as e:
        raise DataError(str(e)) from None
    probs = tuple(expected[direction_name(d)] for d in corpus.directions)
    spec = StreamSpec(
        corpus.shards, corpus.pieces, corpus.directions, seed, data_args.max_bad_record_fraction,
        data_args.max_source_length, data_args.max_target_length, data_args.skip_long_examples, probs,
        endless=not proportional,
    )  # fmt: skip
    return spec, expected


def build_stream_sampler(spec: StreamSpec, expected: dict[str, float], data_args: DataArguments,
                         layout: BatchLayout, tokenizer: Any, log_notes: bool = True,
                         workers: int | None = None) -> StreamSampler:  # fmt: skip
    """The sampler over `spec`, its chunks read in process or by `dataloader_num_workers` processes
    (`workers` overrides it)."""
    import dataclasses

    from trainer.data.stream_sampler import stream_geometry

    longest = max(spec.max_source_length, spec.max_target_length)
    r, window = stream_geometry(layout, longest, len(spec.lanes()))
    spec = dataclasses.replace(spec, chunk_records=r)
    workers = data_args.dataloader_num_workers if workers is None else workers
    if workers > 0:
        per_worker = math.ceil(window / r / min(workers, len(spec.lanes())))
        source: Any = WorkerChunks(
            spec, tokenizer, workers, data_args.dataloader_prefetch_factor * per_worker
        )
    else:
        source = InlineChunks(spec, tokenizer)
    special = tokenizer.special_ids()
    return StreamSampler(spec, source, layout, tokenizer.pad_id, special["decoder_start_token_id"], expected,
                         log_notes)  # fmt: skip


# ----------------------------------------------------------------------------- tokenizer sample


def sample_texts(spec: StreamSpec, expected: dict[str, float], sentences: int, seed: int) -> list[str]:
    """About `sentences` texts (both sides of `sentences / 2` pairs) for training SentencePiece,
    spread over the directions by their expected shares and over each direction's pieces, read at
    random offsets `SAMPLE_RUN` records at a time. A pure function of the corpus and `seed`.

    Raises:
        DataError: no usable pair found in the sample.
    """
    rng = np.random.default_rng([seed, 7])
    pairs_wanted = max(1, sentences // 2)
    texts: list[str] = []
    for d, direction in enumerate(spec.directions):
        quota = math.ceil(pairs_wanted * expected.get(direction_name(direction), 0.0))
        pieces = spec.direction_pieces[d]
        got, probes = 0, 0
        while got < quota and probes < 4 * math.ceil(quota / SAMPLE_RUN) + len(pieces):
            probes += 1
            piece = spec.pieces[pieces[int(rng.integers(len(pieces)))]]
            for record in _records_at_random(spec.shards[piece.shard], piece, rng):
                s, t = record.get(direction[0]), record.get(direction[1])
                if isinstance(s, str) and isinstance(t, str) and s.strip() and t.strip():
                    texts.extend((s, t))
                    got += 1
                    if got >= quota:
                        break
    if not texts:
        raise DataError("the tokenizer sample found no usable pair in the training shards")
    return texts[:sentences]


def _records_at_random(shard: Shard, piece: Piece, rng: np.random.Generator) -> Sequence[dict]:
    """Up to `SAMPLE_RUN` records of `piece` from a random position (a random byte of a plain file,
    else a random record among the first few thousand)."""
    start = 0
    if shard.kind == "jsonl":
        end = shard.size if piece.end < 0 else piece.end
        offset = int(rng.integers(piece.start, max(piece.start + 1, end)))
        with open(shard.path, "rb") as f:
            f.seek(offset)
            f.readline()
            start = f.tell()
        if start >= end:
            start = 0  # the piece's last line: read from its start instead
    else:
        rows = shard.row_groups[piece.start] if shard.kind == "parquet" else shard.records
        start = int(rng.integers(0, max(1, min(rows - SAMPLE_RUN, 4096))))
    records = iter(PieceReader(shard, piece, 1.0, start))
    out = []
    for record in records:
        out.append(record)
        if len(out) >= SAMPLE_RUN:
            break
    records.close()  # type: ignore[attr-defined]
    return out
