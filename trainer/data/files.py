"""Local data files: JSON lines, JSON, Parquet and per-language text files, read into `datasets`.

Lines that cannot be read (not UTF-8, malformed JSON) are dropped and counted (`UNREADABLE`),
up to `max_bad_record_fraction` of a file (`BadLines`); beyond it, or for a file of the wrong
shape, `DataError` names the file and what is valid.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trainer.errors import DataError

logger = logging.getLogger(__name__)


UNREADABLE = "unreadable_line"  # counts lines of a local file (not UTF-8, malformed JSON), dropped on reading
TABLE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


def first_line(e: BaseException) -> str:
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
        raise DataError(f"cannot read {what} {str(path)!r}: {first_line(e)}") from None


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
        raise DataError(f"{what} {str(path)!r} is not valid json: {first_line(e)}") from None


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
        raise DataError(f"{what} {path!r} is not valid {builder}: {first_line(e)}") from None


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


def _string_feature() -> Any:
    import datasets

    return datasets.Value("string")


def _json_translation(ds: Any, languages: Sequence[str], what: str, partial: bool = False) -> Any:
    """Heterogeneous `translation` dicts (datasets infers a `Json` feature): pick the languages."""

    def pick(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rows = [r if isinstance(r, dict) else {} for r in batch["translation"]]
        return {lang: [r.get(lang) for r in rows] for lang in languages}

    have = sorted({k for r in ds[: min(len(ds), 1000)]["translation"] if isinstance(r, dict) for k in r})
    missing = [lang for lang in languages if lang not in have]
    if missing and not partial:
        raise DataError(f"{what} has no {missing[0]!r} text; languages in the data: {have}")
    return ds.map(pick, batched=True, remove_columns=ds.column_names, desc="languages")


def flat_translation(ds: Any, languages: Sequence[str], what: str, partial: bool = False) -> Any:
    """One string column per language: `translation` structs are flattened. A language the data
    lacks is an error, or with `partial` an all-None column."""
    if "translation" in ds.column_names:
        flat = ds.flatten()
        inner = [c for c in flat.column_names if c.startswith("translation.")]
        if not inner:
            return _json_translation(ds, languages, what, partial)
        ds = flat.select_columns(inner).rename_columns({c: c[len("translation.") :] for c in inner})
    missing = [lang for lang in languages if lang not in ds.column_names]
    if missing and partial:
        for lang in missing:
            ds = ds.add_column(lang, [None] * len(ds), feature=_string_feature())
        missing = []
    if missing:
        raise DataError(
            f"{what} has no {missing[0]!r} text; languages in the data: {sorted(ds.column_names)}"
        )
    return ds.select_columns(list(languages))


def read_data_file(
    path: str, languages: Sequence[str], what: str, max_bad: float, partial: bool = False
) -> tuple[Any, int]:
    """One column per language from a local file, and the number of unreadable lines skipped
    (`partial`: a language the file lacks is an all-None column, not an error)."""
    if "{lang}" in path:
        return _read_text_files(path, languages, what, max_bad)
    if not path.endswith(TABLE_SUFFIXES):
        raise DataError(
            f"{what} {path!r}: unknown format; use one of {list(TABLE_SUFFIXES)} "
            "or a text path containing '{lang}' (e.g. data/train.{lang}.gz)"
        )
    table, n_bad = _read_table(path, what, max_bad)
    return flat_translation(table, languages, what, partial), n_bad


def read_data_files(
    entries: Sequence[str], languages: Sequence[str], what: str, max_bad: float
) -> tuple[Any, int]:
    """`read_data_file` over several entries (paths, globs, `{lang}` patterns), concatenated in order.

    With more than one file a file may hold only some of the run's languages (per-direction shards):
    its other languages are empty (None: their pairs count as `missing_side`); a language no file
    holds is an error."""
    import glob

    import datasets

    paths = []
    for entry in entries:
        globbed = "{lang}" not in entry and any(c in entry for c in "*?[")
        found = sorted(glob.glob(entry)) if globbed else [entry]
        if not found:
            raise DataError(f"{what} {entry!r} matches no file")
        paths.extend(found)
    if len(paths) == 1:
        return read_data_file(paths[0], languages, what, max_bad)
    parts, n_bad = [], 0
    for path in paths:
        ds, bad = read_data_file(path, languages, what, max_bad, partial=True)
        parts.append(ds.select_columns(list(languages)))
        n_bad += bad
    absent = [lang for lang in languages if lang not in _languages_present(parts)]
    if absent:
        raise DataError(f"{what} has no {absent[0]!r} text in any of its {len(paths)} files")
    return datasets.concatenate_datasets(parts), n_bad


def _languages_present(parts: Sequence[Any]) -> set[str]:
    """Languages with at least one text in the first rows of some part."""
    out: set[str] = set()
    for ds in parts:
        head = ds[: min(len(ds), 100)]
        out |= {lang for lang, texts in head.items() if any(t is not None for t in texts)}
    return out
