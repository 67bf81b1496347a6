"""Parallel text in, mesh-independent global batches out.

    load_raw_datasets   files / `datasets` name / builtin corpus -> pairs per direction
    tokenize_datasets   pairs -> `__src__ x </s>` / `__tgt__ y </s>` ids (datasets.map, batched,
                        `preprocessing_num_workers` processes, cached as memory-mapped Arrow files)
    GlobalBatchSampler  -> GlobalBatch k (depends on data, seed, global batch size and the
                        direction sampling of `trainer.data.sampling` only; holds lengths, not rows)
    GlobalBatch.shard   -> one dp replica's share: gas x m `Seq2SeqBatch`es
    eval_batches        -> per-direction batches with reference strings for BLEU

Legend: B sentence pairs per micro-batch, m micro-batches per flush (`num_microbatches`),
g flushes per step (`gradient_accumulation_steps`), dp replicas; K = m * g * dp
micro-batch *slots* make one global batch of G = B * K pairs.

A global batch is cut into its K slots canonically (sorted by length, B consecutive
pairs each), so only the *assignment* of slots to (replica, flush, micro-batch) depends
on the mesh: every mesh with the same G trains on the same examples at step k, and
every replica gets exactly m * g micro-batches (collectives never wait on a missing one).

With `max_tokens_per_microbatch` (T) a slot is instead filled greedily, in length order,
while rows x longest <= T; a global batch is K such slots. The sequence then depends on
(data, seed, T, K): meshes with the same K compare step by step.

Bad records are skipped and counted (`SKIP_REASONS`; unreadable lines of local files,
`UNREADABLE`, up to `max_bad_record_fraction` of a file); bad files / languages / configs
raise `DataError` with one line naming the value and what is valid.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from trainer.config.data_args import DataArguments
from trainer.data.files import UNREADABLE, first_line, flat_translation, read_data_file, read_data_files
from trainer.errors import DataError

logger = logging.getLogger(__name__)


# Skip codes stored in the `skip` column; 0 keeps the record. These count pairs (record x direction).
SKIP_REASONS = ("missing_side", "empty_text", "source_too_long", "target_too_long")
Direction = tuple[str, str]


def direction_name(direction: Direction) -> str:
    """`("en", "de") -> "en-de"`."""
    return f"{direction[0]}-{direction[1]}"


def run_languages(data_args: DataArguments) -> list[str]:
    """Every language of the run's directions, sorted."""
    return sorted({lang for d in data_args.directions() for lang in d})


class RawDatasets(NamedTuple):
    """Pairs `{src_lang, tgt_lang, source, target}`: training (all directions mixed) and
    validation per direction name; `skipped[split][reason]` counts dropped pairs."""

    train: Any  # datasets.Dataset
    validation: dict[str, Any]
    skipped: dict[str, dict[str, int]]


def _builtin(
    data_args: DataArguments,
    languages: Sequence[str],
    seed: int,
    splits: Sequence[str] = ("train", "validation"),
) -> list[Any]:
    """The builtin corpus's `splits` ("train", "validation", "test"), one column per language."""
    import datasets

    from trainer.data.corpus import CorpusError, cached_builtin_corpus, to_hf_dataset

    cache = Path(datasets.config.HF_DATASETS_CACHE) / "trainer_builtin"
    try:
        corpus = cached_builtin_corpus(languages, data_args.builtin_size, seed, cache)
    except CorpusError as e:
        raise DataError(str(e)) from None
    return [flat_translation(to_hf_dataset(corpus[split]), languages, "builtin corpus") for split in splits]


def _hub_splits(data_args: DataArguments) -> Any:
    """`dataset_name`'s splits (a `datasets.DatasetDict`): a directory written by `save_to_disk`
    is opened memory-mapped in place (`load_from_disk`); anything else goes to `load_dataset`
    (a Hub name, or a script-free directory of data files)."""
    import datasets

    name, config = data_args.dataset_name, data_args.dataset_config_name
    path = Path(name or "").expanduser()
    if name and name.startswith((".", "/", "~")) and not path.exists():
        raise DataError(
            f"dataset_name={name!r} is a path that does not exist; give a directory or a `datasets` name"
        )
    try:
        if (path / "dataset_dict.json").is_file():
            return datasets.load_from_disk(str(path))
        return datasets.load_dataset(name, config)
    except Exception as e:  # offline / unknown name / bad config: all end here
        raise DataError(
            f"dataset_name={name!r} (config {config!r}) cannot be loaded: {first_line(e)}"
        ) from None


def _hub(data_args: DataArguments, languages: Sequence[str]) -> tuple[Any, Any]:
    name = data_args.dataset_name
    splits = _hub_splits(data_args)
    if "train" not in splits:
        raise DataError(f"dataset_name={name!r} has no 'train' split; it has {list(splits)}")
    what = f"dataset {name!r}"
    val = next((splits[s] for s in ("validation", "dev", "test") if s in splits), None)
    return flat_translation(splits["train"], languages, what), None if val is None else flat_translation(
        val, languages, what
    )


def _load_flat(
    data_args: DataArguments, languages: Sequence[str], seed: int
) -> tuple[Any, Any, dict[str, int]]:
    """Training and validation records (one column per language; validation may be None), and
    the unreadable lines skipped in the local files, by split ("train", "validation").

    Under `streaming` the training records are not read here (`trainer.data.streaming`): train is
    None, and a dataset's validation split is read from its own data files only."""
    unreadable = {"train": 0, "validation": 0}
    max_bad = data_args.max_bad_record_fraction
    train = val = None
    if data_args.streaming:
        if data_args.dataset_name and not data_args.validation_file:
            val, unreadable["validation"] = _stream_validation(data_args, languages)
    elif data_args.dataset_name == "builtin":
        train, val = _builtin(data_args, languages, seed)
    elif data_args.dataset_name:
        train, val = _hub(data_args, languages)
    elif data_args.train_file:
        train, unreadable["train"] = read_data_files(
            data_args.train_files(), languages, "train_file", max_bad
        )
    else:
        raise DataError("no training data: set train_file, or dataset_name (a `datasets` name or 'builtin')")
    if data_args.validation_file:
        val, unreadable["validation"] = read_data_file(
            data_args.validation_file, languages, "validation_file", max_bad
        )
    return train, val, unreadable


def _stream_validation(data_args: DataArguments, languages: Sequence[str]) -> tuple[Any, int]:
    """The validation (or dev, or test) data files of a streamed `dataset_name`, read as local files
    (`load_dataset` would prepare the training split too)."""
    import datasets

    builder = datasets.load_dataset_builder(data_args.dataset_name, data_args.dataset_config_name)
    files = dict(builder.config.data_files or {})
    split = next((s for s in ("validation", "dev", "test") if s in files), None)
    if split is None:
        return None, 0
    what = f"dataset {data_args.dataset_name!r} ({split})"
    return read_data_files([str(f) for f in files[split]], languages, what, data_args.max_bad_record_fraction)


def source_name(data_args: DataArguments) -> str:
    """Where the training data comes from, as the user named it."""
    if data_args.dataset_name:
        return f"dataset_name={data_args.dataset_name!r}"
    return f"train_file={data_args.train_file!r}"


def _bucket(skipped: dict[str, dict[str, int]], split: str) -> dict[str, int]:
    """`skipped[split]`, created with every counter at 0 (unreadable lines first, then SKIP_REASONS)."""
    return skipped.setdefault(split, {UNREADABLE: 0, **dict.fromkeys(SKIP_REASONS, 0)})


def nonzero_skips(skipped: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """`skipped` with only its non-zero counters (splits with none left out): what the log shows.
    run_summary.json keeps every counter; a line of zeros for each of many directions says nothing."""
    out = {split: {k: v for k, v in counts.items() if v} for split, counts in skipped.items()}
    return {split: counts for split, counts in out.items() if counts}


def _pairs_batch(
    batch: dict[str, list[Any]], directions: Sequence[Direction], every_line: bool = False
) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"src_lang": [], "tgt_lang": [], "source": [], "target": [], "skip": []}
    for src, tgt in directions:
        for s, t in zip(batch[src], batch[tgt]):
            if every_line:  # test lines: each one with a source is translated (an empty reference scores 0)
                skip = 1 if s is None else 0
            else:
                skip = 1 if s is None or t is None else 2 if not s.strip() or not t.strip() else 0
            for key, value in zip(out, (src, tgt, s or "", t or "", skip)):
                out[key].append(value)
    return out


def _keep(codes: list[int]) -> list[bool]:
    return [c == 0 for c in codes]


def count_and_drop(ds: Any, split: str, skipped: dict[str, dict[str, int]]) -> Any:
    """Count the `skip` codes into `skipped[split]`, then keep rows with code 0."""
    codes = column_array(ds, "skip")
    counts = np.bincount(codes, minlength=len(SKIP_REASONS) + 1)
    bucket = _bucket(skipped, split)
    for i, reason in enumerate(SKIP_REASONS, start=1):
        bucket[reason] += int(counts[i])
    if counts[1:].any():
        logger.info("%s: skipped %s", split, {k: v for k, v in bucket.items() if v})
    kept = ds.filter(_keep, input_columns="skip", batched=True) if counts[1:].any() else ds
    return kept.remove_columns("skip")


def _to_pairs(
    flat: Any, directions: Sequence[Direction], split: str, skipped: dict[str, dict[str, int]],
    every_line: bool = False,
) -> Any:  # fmt: skip
    pairs = flat.map(
        _pairs_batch,
        batched=True,
        remove_columns=flat.column_names,
        fn_kwargs={"directions": list(directions), "every_line": every_line},
        desc=f"pairs ({split})",
    )
    return count_and_drop(pairs, split, skipped)


def load_raw_datasets(data_args: DataArguments, seed: int, validation: bool = True) -> RawDatasets:
    """Load the run's parallel text as sentence pairs, one row per (record, direction).

    Args:
        data_args: where the data is (`train_file` / `validation_file` / `dataset_name`)
            and the run's directions.
        seed: seed of the builtin corpus.
        validation: False: the validation records are read (a bad file is still an error) but not
            made into pairs, as for a run that evaluates nothing (HF's eval_dataset without do_eval).

    Returns:
        `RawDatasets(train, validation, skipped)`: train mixes all directions; validation
        maps a direction name ("en-de") to its pairs (empty without validation data);
        `skipped` counts per split the unreadable lines of local files (`UNREADABLE`) and
        the pairs with a missing side or empty text.

    Raises:
        DataError: a missing / empty file, more than `max_bad_record_fraction` of a file's
            lines unreadable, a language of the run absent from the data, line counts that
            differ, or no training pair left.
    """
    directions = data_args.directions()
    languages = run_languages(data_args)
    train_flat, val_flat, unreadable = _load_flat(data_args, languages, seed)
    if not validation:
        val_flat = None
    skipped: dict[str, dict[str, int]] = {}
    validation_pairs = _direction_pairs(
        val_flat, data_args, "validation", skipped, unreadable["validation"]
    ) if val_flat is not None else {}  # fmt: skip
    if train_flat is None:  # streaming: trainer.data.streaming reads the training shards
        return RawDatasets(None, validation_pairs, skipped)
    if data_args.max_train_samples is not None:
        train_flat = train_flat.select(range(min(data_args.max_train_samples, len(train_flat))))
    _bucket(skipped, "train")[UNREADABLE] = unreadable["train"]
    train = _to_pairs(train_flat, directions, "train", skipped)
    if len(train) == 0:
        raise DataError(
            f"the training corpus ({source_name(data_args)}) is empty after filtering: no usable record "
            f"for {[direction_name(d) for d in directions]} (skipped: {skipped['train']})"
        )
    logger.info("data: %d training pairs over %d directions; validation %s", len(train), len(directions),
                {k: len(v) for k, v in validation_pairs.items()})  # fmt: skip
    return RawDatasets(train, validation_pairs, skipped)


def _direction_pairs(
    flat: Any, data_args: DataArguments, split: str, skipped: dict[str, dict[str, int]], unreadable: int
) -> dict[str, Any]:
    """Evaluation-style pairs of `flat` per direction name, at most `max_eval_samples` each
    (`max_predict_samples` for the test split, whose every line with a source is kept, in order);
    skips are counted under `"<split>:<direction>"`."""
    out: dict[str, Any] = {}
    test = split == "test"
    cap = data_args.max_predict_samples if test else data_args.max_eval_samples
    for d in data_args.directions():
        name = direction_name(d)
        _bucket(skipped, f"{split}:{name}")[UNREADABLE] = unreadable
        pairs = _to_pairs(flat, [d], f"{split}:{name}", skipped, every_line=test)
        if cap is not None:
            pairs = pairs.select(range(min(cap, len(pairs))))
        out[name] = pairs
    return out


def load_test_pairs(data_args: DataArguments, seed: int) -> RawDatasets:
    """do_predict's test pairs per direction: `test_file` when set, else the `test` split of
    `dataset_name` (a `datasets` name, a directory of data files or of `save_to_disk`, or the
    builtin corpus). Read and filtered as validation data is.

    Returns:
        `RawDatasets(None, test, skipped)`: `test` maps a direction name to its pairs, one per
        line with a source (at most `max_predict_samples`); `skipped["test:<direction>"]` counts
        what was dropped.

    Raises:
        DataError: no test data (neither a test_file nor a dataset with a "test" split), or
            the reading errors of `load_raw_datasets`.
    """
    languages = run_languages(data_args)
    name, unreadable = data_args.dataset_name, 0
    if data_args.test_file:
        flat, unreadable = read_data_file(
            data_args.test_file, languages, "test_file", data_args.max_bad_record_fraction
        )
    elif name == "builtin":
        [flat] = _builtin(data_args, languages, seed, ["test"])  # the training run's corpus (same seed)
    elif name:
        splits = _hub_splits(data_args)
        if "test" not in splits:
            raise DataError(
                f"dataset_name={name!r} has no 'test' split for do_predict; it has {list(splits)} "
                "(or set test_file)"
            )
        flat = flat_translation(splits["test"], languages, f"dataset {name!r}")
    else:
        raise DataError("do_predict needs test data: set test_file, or dataset_name with a 'test' split")
    skipped: dict[str, dict[str, int]] = {}
    return RawDatasets(None, _direction_pairs(flat, data_args, "test", skipped, unreadable), skipped)


def training_texts(pairs: Any) -> Iterator[str]:
    """Each distinct source/target text of the training pairs once (to train SentencePiece)."""
    seen: set[int] = set()
    for batch in pairs.select_columns(["source", "target"]).iter(batch_size=10_000):
        for text in batch["source"] + batch["target"]:
            h = hash(text)
            if h not in seen:
                seen.add(h)
                yield text


def column_array(ds: Any, name: str) -> np.ndarray:
    """An integer column as one numpy array, read through Arrow (`ds[name]` is a lazy column in
    datasets 4+ that numpy would walk row by row: minutes for a million rows)."""
    if len(ds) == 0:
        return np.zeros(0, np.int64)
    column = ds.with_format("arrow").select_columns([name])[:][name]
    return np.asarray(column.to_numpy(), dtype=np.int64)
