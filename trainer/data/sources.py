"""Parallel text in, mesh-independent global batches out.

    load_raw_datasets   files / `datasets` name / builtin corpus -> pairs per direction
    tokenize_datasets   pairs -> `__src__ x </s>` / `__tgt__ y </s>` ids (datasets.map, batched,
                        `preprocessing_num_workers` processes, cached as memory-mapped Arrow files)
    GlobalBatchSampler  -> GlobalBatch k (depends on data, seed, global batch size and the
                        direction sampling of `trainer.sampling` only; holds lengths, not rows)
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

import gzip
import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from models.m2m100 import IGNORE_INDEX, Seq2SeqBatch
from trainer.config import DataArguments
from trainer.sampling import (
    DirectionSampling,
    SamplingError,
    direction_probabilities,
    draw_epoch,
    epoch_counts,
)
from trainer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Skip codes stored in the `skip` column; 0 keeps the record. These count pairs (record x direction).
SKIP_REASONS = ("missing_side", "empty_text", "source_too_long", "target_too_long")
UNREADABLE = "unreadable_line"  # counts lines of a local file (not UTF-8, malformed JSON), dropped on reading
TABLE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")
CHUNK_GLOBAL_BATCHES = 64  # a length-sorting chunk holds this many global batches
Direction = tuple[str, str]


class DataError(ValueError):
    """Bad data or data configuration; the message names the bad value and what is valid."""


def direction_name(direction: Direction) -> str:
    """`("en", "de") -> "en-de"`."""
    return f"{direction[0]}-{direction[1]}"


def run_languages(data_args: DataArguments) -> list[str]:
    """Every language of the run's directions, sorted."""
    return sorted({lang for d in data_args.directions() for lang in d})


# ============================================================================ raw data


class RawDatasets(NamedTuple):
    """Pairs `{src_lang, tgt_lang, source, target}`: training (all directions mixed) and
    validation per direction name; `skipped[split][reason]` counts dropped pairs."""

    train: Any  # datasets.Dataset
    validation: dict[str, Any]
    skipped: dict[str, dict[str, int]]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class BadLines:
    """Unreadable lines of one data file (not UTF-8, malformed JSON): counted, the first few named.

    Bad records in large data are skipped, not fatal (DESIGN "Bad input"); `check` fails the
    run only when the file holds no usable line or more than `max_bad_record_fraction` of
    its lines are bad, which points at a wrong format or encoding rather than a few torn lines.
    """

    EXAMPLES = 5  # lines named in the log / the error

    def __init__(self, what: str, path: str | Path) -> None:
        self.what, self.path = what, str(path)
        self.lines = 0  # lines that should hold a record (blank JSON lines excluded)
        self.bad = 0
        self.examples: list[str] = []

    def add(self, lineno: int, why: str) -> None:
        self.bad += 1
        if len(self.examples) < self.EXAMPLES:
            self.examples.append(f"line {lineno}: {why}")

    def check(self, max_fraction: float) -> int:
        """Raise if nothing is usable or too much is bad; otherwise log the skips.

        Returns:
            The number of bad lines (skipped).

        Raises:
            DataError: naming the file, the counts and the first bad lines.
        """
        where = f"{self.what} {self.path!r}"
        first = "; ".join(self.examples)
        if self.lines == 0:
            raise DataError(f"{where} is empty: it holds no record")
        if self.bad == self.lines:
            raise DataError(f"{where} has no usable record: all {self.lines} lines are unreadable ({first})")
        if self.bad > max_fraction * self.lines:
            raise DataError(
                f"{where}: {self.bad} of {self.lines} lines ({self.bad / self.lines:.1%}) are unreadable, "
                f"above max_bad_record_fraction={max_fraction} ({first})"
            )
        if self.bad:
            logger.warning("%s: skipped %d unreadable line(s) of %d (%s)", where, self.bad, self.lines, first)
        return self.bad


def _open(path: Path) -> Any:
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def _decoded_lines(path: Path, what: str) -> Iterator[tuple[int, str | None, str]]:
    """(line number from 1, text without the newline or None, why None) of each line of `path`."""
    try:
        with _open(path) as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    yield lineno, raw.decode("utf-8").rstrip("\r\n"), ""
                except UnicodeDecodeError as e:
                    yield lineno, None, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
    except (OSError, EOFError) as e:  # unreadable / truncated gzip
        raise DataError(f"cannot read {what} {str(path)!r}: {_first_line(e)}") from None


def _is_utf8(path: Path) -> bool:
    """One streaming pass at C speed: datasets' JSON reader does not check the encoding."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with _open(path) as f:
            while chunk := f.read(1 << 24):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except (UnicodeDecodeError, OSError, EOFError):
        return False
    return True


def _read_json_lines(path: Path, what: str, max_bad: float) -> tuple[Any, int]:
    """JSON lines read one by one: unreadable lines are skipped and counted (see `BadLines`)."""
    import datasets

    bad, records = BadLines(what, path), []
    for lineno, text, why in _decoded_lines(path, what):
        if text is not None and not text.strip():
            continue  # a blank line is no record (as in datasets' JSON reader)
        bad.lines += 1
        if text is None:
            bad.add(lineno, why)
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            bad.add(lineno, f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(record, dict):
            bad.add(lineno, f"a JSON {type(record).__name__}, not an object")
            continue
        records.append(record)
    n_bad = bad.check(max_bad)
    try:
        return datasets.Dataset.from_list(records), n_bad
    except Exception as e:  # arrow cannot unify the records' types
        raise DataError(f"{what} {str(path)!r} is not valid json: {_first_line(e)}") from None


def _read_table(path: str, what: str, max_bad: float) -> tuple[Any, int]:
    """JSON (lines) or Parquet via `datasets.load_dataset`; JSON that fails it, or is not UTF-8,
    is read line by line so that bad lines are skipped and counted, not fatal.

    Returns:
        (records, number of unreadable lines skipped).
    """
    import datasets

    if not Path(path).is_file():
        raise DataError(f"{what} {path!r} does not exist")
    builder = "parquet" if path.endswith(".parquet") else "json"
    if builder == "json" and not _is_utf8(Path(path)):
        return _read_json_lines(Path(path), what, max_bad)
    try:
        return datasets.load_dataset(builder, data_files=path, split="train"), 0
    except Exception as e:  # datasets raises many types (DatasetGenerationError, ArrowInvalid, ...)
        if builder == "json":
            return _read_json_lines(Path(path), what, max_bad)
        raise DataError(f"{what} {path!r} is not valid {builder}: {_first_line(e)}") from None


def _read_text_files(pattern: str, languages: Sequence[str], what: str, max_bad: float) -> tuple[Any, int]:
    """Line-aligned files, one per language: `pattern` holds `{lang}`.

    A line that is not UTF-8 drops that line number from every language (alignment kept).
    Two streaming passes (check, then write Arrow through `datasets`' cache, memory-mapped),
    so a corpus larger than memory is never held in it.
    """
    import datasets

    paths: dict[str, str] = {}
    counts: dict[str, int] = {}
    skipped: set[int] = set()
    for lang in languages:
        path = Path(pattern.format(lang=lang))
        if not path.is_file():
            found = sorted(p.name for p in path.parent.glob(Path(pattern).name.replace("{lang}", "*")))
            raise DataError(f"{what}: no file {str(path)!r} for language {lang!r}; files there: {found}")
        bad = BadLines(what, path)
        for lineno, text, why in _decoded_lines(path, what):
            bad.lines += 1
            if text is None:
                bad.add(lineno, why)
                skipped.add(lineno - 1)
        bad.check(max_bad)
        paths[lang], counts[str(path)] = str(path), bad.lines
    if len(set(counts.values())) > 1:
        raise DataError(f"{what}: text files are not line-aligned, line counts differ: {counts}")
    stats = [(p, Path(p).stat().st_size, Path(p).stat().st_mtime_ns) for p in paths.values()]
    key = hashlib.sha256(json.dumps([stats, sorted(skipped)]).encode()).hexdigest()[:32]
    features = datasets.Features({lang: datasets.Value("string") for lang in paths})
    ds = datasets.Dataset.from_generator(
        _text_rows, features=features, gen_kwargs={"paths": paths, "skip": sorted(skipped)}, fingerprint=key
    )
    return ds, len(skipped)


def _text_rows(paths: dict[str, str], skip: list[int]) -> Iterator[dict[str, str | None]]:
    """The rows of line-aligned files, without the line indices in `skip` (for `from_generator`)."""
    drop = set(skip)
    readers = [_decoded_lines(Path(p), "text file") for p in paths.values()]
    for i, lines in enumerate(zip(*readers)):
        if i not in drop:
            yield {lang: text for lang, (_, text, _) in zip(paths, lines)}


def _json_translation(ds: Any, languages: Sequence[str], what: str) -> Any:
    """Heterogeneous `translation` dicts (datasets infers a `Json` feature): pick the languages."""

    def pick(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rows = [r if isinstance(r, dict) else {} for r in batch["translation"]]
        return {lang: [r.get(lang) for r in rows] for lang in languages}

    have = sorted({k for r in ds[: min(len(ds), 1000)]["translation"] if isinstance(r, dict) for k in r})
    missing = [lang for lang in languages if lang not in have]
    if missing:
        raise DataError(f"{what} has no {missing[0]!r} text; languages in the data: {have}")
    return ds.map(pick, batched=True, remove_columns=ds.column_names, desc="languages")


def _flat(ds: Any, languages: Sequence[str], what: str) -> Any:
    """One string column per language: `translation` structs are flattened."""
    if "translation" in ds.column_names:
        flat = ds.flatten()
        inner = [c for c in flat.column_names if c.startswith("translation.")]
        if not inner:
            return _json_translation(ds, languages, what)
        ds = flat.select_columns(inner).rename_columns({c: c[len("translation.") :] for c in inner})
    missing = [lang for lang in languages if lang not in ds.column_names]
    if missing:
        raise DataError(
            f"{what} has no {missing[0]!r} text; languages in the data: {sorted(ds.column_names)}"
        )
    return ds.select_columns(list(languages))


def _read_file(path: str, languages: Sequence[str], what: str, max_bad: float) -> tuple[Any, int]:
    """One column per language from a local file, and the number of unreadable lines skipped."""
    if "{lang}" in path:
        return _read_text_files(path, languages, what, max_bad)
    if not path.endswith(TABLE_SUFFIXES):
        raise DataError(
            f"{what} {path!r}: unknown format; use one of {list(TABLE_SUFFIXES)} "
            "or a text path containing '{lang}' (e.g. data/train.{lang}.gz)"
        )
    table, n_bad = _read_table(path, what, max_bad)
    return _flat(table, languages, what), n_bad


def _builtin(
    data_args: DataArguments,
    languages: Sequence[str],
    seed: int,
    splits: Sequence[str] = ("train", "validation"),
) -> list[Any]:
    """The builtin corpus's `splits` ("train", "validation", "test"), one column per language."""
    from trainer.corpus import CorpusError, build_builtin_corpus, to_hf_dataset

    try:
        corpus = build_builtin_corpus(languages, data_args.builtin_size, seed)
    except CorpusError as e:
        raise DataError(str(e)) from None
    return [_flat(to_hf_dataset(corpus[split]), languages, "builtin corpus") for split in splits]


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
            f"dataset_name={name!r} (config {config!r}) cannot be loaded: {_first_line(e)}"
        ) from None


def _hub(data_args: DataArguments, languages: Sequence[str]) -> tuple[Any, Any]:
    name = data_args.dataset_name
    splits = _hub_splits(data_args)
    if "train" not in splits:
        raise DataError(f"dataset_name={name!r} has no 'train' split; it has {list(splits)}")
    what = f"dataset {name!r}"
    val = next((splits[s] for s in ("validation", "dev", "test") if s in splits), None)
    return _flat(splits["train"], languages, what), None if val is None else _flat(val, languages, what)


def _load_flat(
    data_args: DataArguments, languages: Sequence[str], seed: int
) -> tuple[Any, Any, dict[str, int]]:
    """Training and validation records (one column per language; validation may be None), and
    the unreadable lines skipped in the local files, by split ("train", "validation")."""
    unreadable = {"train": 0, "validation": 0}
    max_bad = data_args.max_bad_record_fraction
    if data_args.dataset_name == "builtin":
        train, val = _builtin(data_args, languages, seed)
    elif data_args.dataset_name:
        train, val = _hub(data_args, languages)
    elif data_args.train_file:
        (train, unreadable["train"]), val = (
            _read_file(data_args.train_file, languages, "train_file", max_bad),
            None,
        )
    else:
        raise DataError("no training data: set train_file, or dataset_name (a `datasets` name or 'builtin')")
    if data_args.validation_file:
        val, unreadable["validation"] = _read_file(
            data_args.validation_file, languages, "validation_file", max_bad
        )
    return train, val, unreadable


def _source(data_args: DataArguments) -> str:
    """Where the training data comes from, as the user named it."""
    if data_args.dataset_name:
        return f"dataset_name={data_args.dataset_name!r}"
    return f"train_file={data_args.train_file!r}"


def _bucket(skipped: dict[str, dict[str, int]], split: str) -> dict[str, int]:
    """`skipped[split]`, created with every counter at 0 (unreadable lines first, then SKIP_REASONS)."""
    return skipped.setdefault(split, {UNREADABLE: 0, **dict.fromkeys(SKIP_REASONS, 0)})


def _pairs_batch(batch: dict[str, list[Any]], directions: Sequence[Direction]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"src_lang": [], "tgt_lang": [], "source": [], "target": [], "skip": []}
    for src, tgt in directions:
        for s, t in zip(batch[src], batch[tgt]):
            skip = 1 if s is None or t is None else 2 if not s.strip() or not t.strip() else 0
            for key, value in zip(out, (src, tgt, s or "", t or "", skip)):
                out[key].append(value)
    return out


def _keep(codes: list[int]) -> list[bool]:
    return [c == 0 for c in codes]


def _count_and_drop(ds: Any, split: str, skipped: dict[str, dict[str, int]]) -> Any:
    """Count the `skip` codes into `skipped[split]`, then keep rows with code 0."""
    codes = _column(ds, "skip")
    counts = np.bincount(codes, minlength=len(SKIP_REASONS) + 1)
    bucket = _bucket(skipped, split)
    for i, reason in enumerate(SKIP_REASONS, start=1):
        bucket[reason] += int(counts[i])
    if counts[1:].any():
        logger.info("%s: skipped %s", split, {k: v for k, v in bucket.items() if v})
    kept = ds.filter(_keep, input_columns="skip", batched=True) if counts[1:].any() else ds
    return kept.remove_columns("skip")


def _to_pairs(
    flat: Any, directions: Sequence[Direction], split: str, skipped: dict[str, dict[str, int]]
) -> Any:
    pairs = flat.map(
        _pairs_batch,
        batched=True,
        remove_columns=flat.column_names,
        fn_kwargs={"directions": list(directions)},
        desc=f"pairs ({split})",
    )
    return _count_and_drop(pairs, split, skipped)


def load_raw_datasets(data_args: DataArguments, seed: int) -> RawDatasets:
    """Load the run's parallel text as sentence pairs, one row per (record, direction).

    Args:
        data_args: where the data is (`train_file` / `validation_file` / `dataset_name`)
            and the run's directions.
        seed: seed of the builtin corpus.

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
    if data_args.max_train_samples is not None:
        train_flat = train_flat.select(range(min(data_args.max_train_samples, len(train_flat))))
    skipped: dict[str, dict[str, int]] = {}
    _bucket(skipped, "train")[UNREADABLE] = unreadable["train"]
    train = _to_pairs(train_flat, directions, "train", skipped)
    if len(train) == 0:
        raise DataError(
            f"the training corpus ({_source(data_args)}) is empty after filtering: no usable record "
            f"for {[direction_name(d) for d in directions]} (skipped: {skipped['train']})"
        )
    validation = _direction_pairs(
        val_flat, data_args, "validation", skipped, unreadable["validation"]
    ) if val_flat is not None else {}  # fmt: skip
    logger.info("data: %d training pairs over %d directions; validation %s", len(train), len(directions),
                {k: len(v) for k, v in validation.items()})  # fmt: skip
    return RawDatasets(train, validation, skipped)


def _direction_pairs(
    flat: Any, data_args: DataArguments, split: str, skipped: dict[str, dict[str, int]], unreadable: int
) -> dict[str, Any]:
    """Evaluation-style pairs of `flat` per direction name, at most `max_eval_samples` each;
    skips are counted under `"<split>:<direction>"`."""
    out: dict[str, Any] = {}
    for d in data_args.directions():
        name = direction_name(d)
        _bucket(skipped, f"{split}:{name}")[UNREADABLE] = unreadable
        pairs = _to_pairs(flat, [d], f"{split}:{name}", skipped)
        if data_args.max_eval_samples is not None:
            pairs = pairs.select(range(min(data_args.max_eval_samples, len(pairs))))
        out[name] = pairs
    return out


def load_test_pairs(data_args: DataArguments, seed: int) -> RawDatasets:
    """do_predict's test pairs per direction: `test_file` when set, else the `test` split of
    `dataset_name` (a `datasets` name, a directory of data files or of `save_to_disk`, or the
    builtin corpus). Read and filtered as validation data is.

    Returns:
        `RawDatasets(None, test, skipped)`: `test` maps a direction name to its pairs (at most
        `max_eval_samples`); `skipped["test:<direction>"]` counts what was dropped.

    Raises:
        DataError: no test data (neither a test_file nor a dataset with a "test" split), or
            the reading errors of `load_raw_datasets`.
    """
    languages = run_languages(data_args)
    name, unreadable = data_args.dataset_name, 0
    if data_args.test_file:
        flat, unreadable = _read_file(
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
        flat = _flat(splits["test"], languages, f"dataset {name!r}")
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


# ============================================================================ tokenization


def _tokenize_batch(
    batch: dict[str, list[Any]], tokenizer: Tokenizer, max_source_length: int, max_target_length: int
) -> dict[str, list[Any]]:
    eos = tokenizer.eos_id
    src = tokenizer.encode_batch(batch["source"])
    tgt = tokenizer.encode_batch(batch["target"])
    input_ids = [[tokenizer.lang_id(lang), *ids, eos] for lang, ids in zip(batch["src_lang"], src)]
    labels = [[tokenizer.lang_id(lang), *ids, eos] for lang, ids in zip(batch["tgt_lang"], tgt)]
    skip = [
        3 if len(s) > max_source_length else 4 if len(t) > max_target_length else 0
        for s, t in zip(input_ids, labels)
    ]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "src_len": [len(s) for s in input_ids],
        "tgt_len": [len(t) for t in labels],
        "skip": skip,
    }


def _fingerprint(ds: Any, tokenizer: Tokenizer, max_src: int, max_tgt: int) -> str:
    """A cache key for the tokenized dataset: the pairs' `datasets` fingerprint (a hash of their
    content and the transforms that made them, stable across processes), the lengths, and the
    tokenizer's identity (its model bytes, or its vocabulary; the object itself does not hash)."""
    h = hashlib.sha256(f"{ds._fingerprint}|{max_src}|{max_tgt}|{tokenizer.languages}".encode())
    hf = getattr(tokenizer, "hf", None)
    h.update(getattr(tokenizer, "model_proto", b"") or str(hf).encode())
    if hf is not None:  # str(hf) names the tokenizer, not its pieces
        h.update(json.dumps(sorted(hf.get_vocab().items())).encode())
    return h.hexdigest()[:32]


def tokenize_pairs(pairs: Any, tokenizer: Tokenizer, data_args: DataArguments, split: str,
                   skipped: dict[str, dict[str, int]], keep_text: bool = False,
                   cache_dir: Path | None = None) -> Any:  # fmt: skip
    """Tokenize pairs into model examples; over-long ones are skipped and counted.

    With `cache_dir` the examples are written there as Arrow files named by `_fingerprint` and
    memory-mapped (not held in memory); a later call with the same data, tokenizer and lengths
    loads them instead of tokenizing again. `data_args.preprocessing_num_workers` processes
    tokenize in parallel (the result is the same as with one).

    Args:
        pairs: `{src_lang, tgt_lang, source, target}` rows.
        tokenizer: the run's tokenizer.
        data_args: `max_source_length` / `max_target_length` (counting tag and eos).
        split: name under which skips are counted in `skipped`.
        skipped: `{split: {reason: count}}`, updated in place.
        keep_text: keep `source` / `target` strings (for evaluation references).
        cache_dir: the directory of the on-disk cache (None: no cache of ours).

    Returns:
        Rows with `input_ids` (`__src__ x </s>`), `labels` (`__tgt__ y </s>`), `src_len`,
        `tgt_len`, `src_lang`, `tgt_lang` (and the texts when `keep_text`).
    """
    max_src, max_tgt = data_args.max_source_length, data_args.max_target_length
    drop = [] if keep_text else ["source", "target"]
    fingerprint = _fingerprint(pairs, tokenizer, max_src, max_tgt) + ("t" if keep_text else "")
    workers = data_args.preprocessing_num_workers
    cache: dict[str, Any] = {}
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache = {
            "cache_file_name": str(cache_dir / f"tokenized-{fingerprint}.arrow"),
            "load_from_cache_file": True,
        }
    out = pairs.map(
        _tokenize_batch,
        batched=True,
        remove_columns=drop,
        fn_kwargs={"tokenizer": tokenizer, "max_source_length": max_src, "max_target_length": max_tgt},
        new_fingerprint=fingerprint,
        num_proc=workers if workers and workers > 1 and len(pairs) >= workers else None,
        desc=f"tokenize ({split})",
        **cache,
    )
    return _count_and_drop(out, split, skipped)


@dataclass
class TranslationData:
    """Tokenized training examples, validation per direction, and skip counts."""

    train: Any
    validation: dict[str, Any]
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)


def tokenize_datasets(
    raw: RawDatasets, tokenizer: Tokenizer, data_args: DataArguments, cache_dir: Path | None = None
) -> TranslationData:
    """Tokenize the output of `load_raw_datasets` (see `tokenize_pairs`; `cache_dir`: where the
    tokenized splits are cached and memory-mapped, None for no cache of ours).

    Raises:
        DataError: if no training example is left after filtering.
    """
    skipped = {k: dict(v) for k, v in raw.skipped.items()}
    train = tokenize_pairs(raw.train, tokenizer, data_args, "train", skipped, cache_dir=cache_dir)
    if len(train) == 0:
        raise DataError(
            f"the training corpus ({_source(data_args)}) is empty after filtering (skipped: {skipped['train']}); "
            f"max_source_length={data_args.max_source_length}, max_target_length={data_args.max_target_length}"
        )
    validation = {
        name: tokenize_pairs(ds, tokenizer, data_args, f"validation:{name}", skipped, True, cache_dir)
        for name, ds in raw.validation.items()
    }
    return TranslationData(train, validation, skipped)


# ============================================================================ collation


def collate(input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], pad_id: int,
            decoder_start_id: int) -> Seq2SeqBatch:  # fmt: skip
    """Right-pad examples into a `Seq2SeqBatch` trimmed to its own longest source / target.

    decoder_input_ids = [decoder_start] + labels[:-1]  (M2M100: `</s> __tgt__ y`).
    """
    b = len(input_ids)
    s_len = max(len(x) for x in input_ids)
    t_len = max(len(y) for y in labels)
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


# ============================================================================ global batches


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch is cut: K = m * g * dp slots of B pairs (or <= T padded tokens)."""

    per_device_batch_size: int
    num_microbatches: int = 1
    gradient_accumulation_steps: int = 1
    dp_size: int = 1
    max_tokens_per_microbatch: int | None = None

    def __post_init__(self) -> None:
        for name in ("per_device_batch_size", "num_microbatches", "gradient_accumulation_steps", "dp_size"):
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
            return {"max_tokens_per_microbatch": self.max_tokens_per_microbatch, "num_slots": self.num_slots}
        return {"global_batch_size": int(self.per_device_batch_size * self.num_slots)}

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

    @property
    def num_examples(self) -> int:
        return int(sum(len(s) for s in self.slots))

    def example_indices(self) -> list[int]:
        """All example indices of the global batch, sorted."""
        return sorted(int(i) for s in self.slots for i in s)

    def replica_slots(self, dp_rank: int) -> list[list[np.ndarray]]:
        """Replica `dp_rank`'s slots as [flush][micro-batch] index arrays."""
        lay = self.layout
        if not 0 <= dp_rank < lay.dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, {lay.dp_size})")
        return [
            [self.slots[lay.slot(dp_rank, g, j)] for j in range(lay.num_microbatches)]
            for g in range(lay.gradient_accumulation_steps)
        ]

    def shard(self, dp_rank: int) -> list[list[Seq2SeqBatch]]:
        """Replica `dp_rank`'s share: `gradient_accumulation_steps` lists of
        `num_microbatches` padded batches, each trimmed to its own longest sequence."""
        return [[self.fetch(idx) for idx in flush] for flush in self.replica_slots(dp_rank)]


def _column(ds: Any, name: str) -> np.ndarray:
    """An integer column as one numpy array, read through Arrow (`ds[name]` is a lazy column in
    datasets 4+ that numpy would walk row by row: minutes for a million rows)."""
    if len(ds) == 0:
        return np.zeros(0, np.int64)
    column = ds.with_format("arrow").select_columns([name])[:][name]
    return np.asarray(column.to_numpy(), dtype=np.int64)


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


def _sentence_slots(order: np.ndarray, lengths: np.ndarray, layout: BatchLayout) -> list[list[np.ndarray]]:
    g, b = layout.per_device_batch_size * layout.num_slots, layout.per_device_batch_size
    batches = []
    for start in range(0, len(order) - g + 1, g):
        members = order[start : start + g]
        members = members[np.argsort(lengths[members], kind="stable")]
        batches.append([members[k * b : (k + 1) * b] for k in range(layout.num_slots)])
    return batches


def _token_slots(order: np.ndarray, lengths: np.ndarray, layout: BatchLayout) -> list[list[np.ndarray]]:
    cap, k = layout.max_tokens_per_microbatch or 0, layout.num_slots
    batches: list[list[np.ndarray]] = []
    slots: list[np.ndarray] = []
    start, longest = 0, 0
    for pos, length in enumerate(lengths[order].tolist()):
        if pos > start and (pos - start + 1) * max(longest, length) > cap:
            slots.append(order[start:pos])
            start, longest = pos, 0
            if len(slots) == k:
                batches.append(slots)
                slots = []
        longest = max(longest, length)
    return batches  # the trailing partial global batch is dropped


class GlobalBatchSampler:
    """Length-bucketed, seeded, resumable sequence of global batches over epochs.

    Per epoch: shuffle all examples (seed, epoch) -- or, with temperature / weighted sampling
    across directions (`trainer.sampling`), draw N examples by direction and shuffle them; cut into chunks of
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
        self.pad_id, self.decoder_start_id = pad_id, decoder_start_id
        self.src_len, self.tgt_len = _column(train, "src_len"), _column(train, "tgt_len")
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
        if lay.max_tokens_per_microbatch and n and int(self.lengths.max()) > lay.max_tokens_per_microbatch:
            raise DataError(
                f"max_tokens_per_microbatch={lay.max_tokens_per_microbatch} is below the longest example "
                f"({int(self.lengths.max())} tokens); raise it or lower max_source_length/max_target_length"
            )
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
        rows = self.train.select_columns(["input_ids", "labels"])[[int(i) for i in indices]]
        return collate(rows["input_ids"], rows["labels"], self.pad_id, self.decoder_start_id)

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
        batch = GlobalBatch(self.step, self.epoch, slots, num_tokens, num_src, self.layout, self._fetch)
        self.drawn += np.bincount(self.direction_of[np.concatenate(slots)], minlength=len(self.directions))
        self.position += 1
        self.step += 1
        return batch

    def example_lengths(self, batch: GlobalBatch) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) token counts of every example of `batch` (host arrays)."""
        idx = np.concatenate(batch.slots)
        return self.src_len[idx], self.tgt_len[idx]

    def shares(self) -> dict[str, dict[str, float]]:
        """Per direction: the `expected` share p_d, the `realised` share of the examples served so
        far (over the run: the counts travel in the state dict) and the `examples` count."""
        total = max(1, int(self.drawn.sum()))
        return {
            name: {"expected": round(p, 6), "realised": round(int(n) / total, 6), "examples": int(n)}
            for (name, p), n in zip(self.probabilities.items(), self.drawn)
        }

    def shares_since(self, mark: np.ndarray) -> dict[str, float]:
        """Per direction, its fraction of the examples served since `mark` (an earlier copy of
        `drawn`): the sampled shares of a logging window."""
        window = self.drawn - mark
        total = max(1, int(window.sum()))
        return {name: round(int(n) / total, 6) for name, n in zip(self.directions, window)}

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


# ============================================================================ evaluation


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
        order = np.argsort(_column(ds, "src_len"), kind="stable") if len(ds) else np.zeros(0, np.int64)
        batches = []
        for start in range(0, len(order), batch_size):
            rows = ds[[int(i) for i in order[start : start + batch_size]]]
            batch = collate(rows["input_ids"], rows["labels"], tokenizer.pad_id, tokenizer.eos_id)
            batches.append(EvalBatch(name, batch, rows["source"], rows["target"], tokenizer.lang_id(tgt)))
        out[name] = batches
    return out
