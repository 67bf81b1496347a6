"""Training corpora as shards on disk, read piece by piece without ever holding a shard in memory.

    resolve_shards   train_file (a path, a glob, a list of them; `{lang}` text patterns) -> shards,
                     each probed once: its languages (first record), an error if missing or empty
    split_pieces     shards -> pieces, the unit the stream permutes: a byte range of about
                     `PIECE_BYTES` of a plain JSON-lines file (cut at line starts), a row group of a
                     Parquet file, a whole gzip or per-language text file (not seekable)
    PieceReader      one piece's records, resumable at a saved position (`position()`): a byte
                     offset (plain), a row (Parquet) or a line count (gzip / text, re-read to it)

Formats: JSON lines in the Hugging Face translation format (`{"translation": {"en": ..}}`) or flat
(`{"en": .., "de": ..}`), plain or `.gz`; Parquet with a `translation` struct or one column per
language; line-aligned text files per language given as a pattern with `{lang}`
(`data/train-*.{lang}.gz`). A line that cannot be read (not UTF-8, malformed JSON) is skipped and
counted, named by shard and line; above `max_bad_record_fraction` of a piece the run stops naming
them (`trainer.data.files.BadLines`). A piece belongs to its shard: line numbers are the shard's.

No function here imports torch: data-loader worker processes import this module.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.data.files import BadLines, first_line
from trainer.errors import DataError

PIECE_BYTES = 8 << 20  # a plain JSON-lines shard is cut into pieces of about this size
PROBE_LINES = 64  # first lines read per shard at start-up (languages, records per byte)
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
STREAM_SUFFIXES = (*JSON_SUFFIXES, ".parquet")
Record = dict[str, Any]


@dataclass(frozen=True)
class Shard:
    """One file of the corpus (or one aligned set of per-language text files)."""

    path: str  # the file; for text, the pattern with its wildcard filled (still holding `{lang}`)
    kind: str  # "jsonl" (plain), "jsonl.gz", "parquet", "text"
    size: int  # bytes on disk (text: over its language files)
    languages: tuple[str, ...]  # the languages its records hold (probed from the first record)
    files: tuple[tuple[str, str], ...] = ()  # text: (language, path) of each file
    row_groups: tuple[int, ...] = ()  # parquet: rows per row group
    records: int = 0  # records it holds: exact for Parquet, else estimated from its first lines


@dataclass(frozen=True)
class Piece:
    """A part of shard `shard`: bytes [start, end) of a plain file, row groups [start, end) of a
    Parquet file, or the whole file (start 0, end -1)."""

    shard: int
    start: int = 0
    end: int = -1


# ----------------------------------------------------------------------------- resolving shards


def _kind(path: str) -> str:
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".gz"):
        return "jsonl.gz"
    return "jsonl"


def _expand(spec: str, what: str) -> list[str]:
    """One entry of train_file: a path or a glob, sorted; a glob that matches nothing is an error."""
    if any(c in spec for c in "*?["):
        found = sorted(glob.glob(os.path.expanduser(spec)))
        if not found:
            raise DataError(f"{what} {spec!r} matches no file")
        return found
    return [os.path.expanduser(spec)]


def _text_shards(
    pattern: str, languages: Sequence[str], what: str
) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """`data/train-*.{lang}.gz` -> one entry per wildcard match (`*`, `?`): (the pattern with its
    wildcards filled, `{lang}` kept; the files per language). A match's languages are those whose
    file exists; the caller keeps a shard with two or more."""
    parts = re.split(r"(\*|\?|\{lang\})", os.path.expanduser(pattern))
    by_key: dict[str, dict[str, str]] = {}
    for lang in languages:
        regex = "".join(
            "([^/]*)"
            if p == "*"
            else "([^/])"
            if p == "?"
            else re.escape(lang)
            if p == "{lang}"
            else re.escape(p)
            for p in parts
        )
        spec = "".join(lang if p == "{lang}" else p for p in parts)
        for path in sorted(glob.glob(spec)) if ("*" in spec or "?" in spec) else [spec]:
            match = re.fullmatch(regex, path)
            if match is None or not os.path.isfile(path):
                continue
            fills = iter(match.groups())
            key = "".join(next(fills) if p in ("*", "?") else p for p in parts)
            by_key.setdefault(key, {})[lang] = path
    if not by_key:
        tried = [pattern.replace("{lang}", lang) for lang in languages]
        raise DataError(f"{what} {pattern!r}: no file for any language of the run (tried {tried})")
    return [(key, tuple(sorted(files.items()))) for key, files in sorted(by_key.items())]


def resolve_shards(
    spec: str | Sequence[str], languages: Sequence[str], what: str = "train_file"
) -> list[Shard]:
    """The shards named by `spec`, each checked and probed (one open and one record each).

    Args:
        spec: a path, a glob, a `{lang}` text pattern, or a list of those (or a comma-separated string).
        languages: the run's languages (text patterns are filled with them).
        what: the config field, for messages.

    Returns:
        The shards, in the order given (globs sorted), without duplicates.

    Raises:
        DataError: a path that does not exist, a glob that matches nothing, an unknown format, an
            empty shard, a JSON array file (not streamable), or an unreadable first record.
    """
    entries = [spec] if isinstance(spec, str) else list(spec)
    entries = [e.strip() for item in entries for e in str(item).split(",") if e.strip()]
    shards: list[Shard] = []
    seen: set[str] = set()
    for entry in entries:
        if "{lang}" in entry:
            for key, files in _text_shards(entry, languages, what):
                if key not in seen and len(files) >= 2:
                    seen.add(key)
                    shards.append(_probe_text(key, files, what))
            continue
        for path in _expand(entry, what):
            if path in seen:
                continue
            seen.add(path)
            shards.append(_probe(path, what))
    if not shards:
        raise DataError(f"{what}={spec!r} names no shard")
    for shard in shards:
        if shard.size == 0:
            raise DataError(f"{what}: shard {shard.path!r} is empty (0 bytes)")
    return shards


def _probe(path: str, what: str) -> Shard:
    if not os.path.isfile(path):
        raise DataError(f"{what}: shard {path!r} does not exist")
    if not path.endswith(STREAM_SUFFIXES):
        raise DataError(
            f"{what}: shard {path!r} has an unknown format; use one of {list(STREAM_SUFFIXES)} "
            "or a text pattern containing '{lang}' (e.g. data/train-*.{lang}.gz)"
        )
    kind, size = _kind(path), os.path.getsize(path)
    if size == 0:
        raise DataError(f"{what}: shard {path!r} is empty (0 bytes)")
    if kind == "parquet":
        return _probe_parquet(path, what, size)
    languages: set[str] = set()
    lines = read = 0
    try:
        with _open_binary(path, kind) as f:
            for raw in f:
                lines, read = lines + 1, read + len(raw)
                if raw.lstrip().startswith(b"[") and not languages:
                    raise DataError(
                        f"{what}: shard {path!r} is a JSON array; streaming reads JSON lines "
                        "(one object per line): convert it, e.g. with `jq -c '.[]'`"
                    )
                record = _record(raw) if raw.strip() else None
                if isinstance(record, dict):
                    languages |= {k for k, v in record.items() if isinstance(v, str)}
                if lines >= PROBE_LINES:
                    break
    except (OSError, EOFError) as e:
        raise DataError(f"{what}: cannot read shard {path!r}: {first_line(e)}") from None
    if not languages:
        raise DataError(f"{what}: shard {path!r} holds no readable record in its first {lines} line(s)")
    unpacked = _gzip_size(path, size) if kind.endswith(".gz") else size
    return Shard(path, kind, size, tuple(sorted(languages)), records=max(1, unpacked * lines // max(1, read)))


def _gzip_size(path: str, size: int) -> int:
    """The uncompressed size a gzip file records in its trailer (mod 2^32; a file that wrapped is
    taken at 4x its compressed size)."""
    with open(path, "rb") as f:
        f.seek(-4, os.SEEK_END)
        isize = int.from_bytes(f.read(4), "little")
    return isize if isize >= size else 4 * size


def _probe_text(key: str, files: tuple[tuple[str, str], ...], what: str) -> Shard:
    """Aligned text files: records estimated from the first lines of the first language's file."""
    sizes = [os.path.getsize(p) for _, p in files]
    for (_, p), n in zip(files, sizes):
        if n == 0:
            raise DataError(f"{what}: shard {p!r} is empty (0 bytes)")
    lang, path = files[0]
    lines = read = 0
    with _open_binary(path, "") as f:
        for raw in f:
            lines, read = lines + 1, read + len(raw)
            if lines >= PROBE_LINES:
                break
    unpacked = _gzip_size(path, sizes[0]) if path.endswith(".gz") else sizes[0]
    records = max(1, unpacked * lines // max(1, read))
    return Shard(key, "text", sum(sizes), tuple(x for x, _ in files), files, records=records)


def _probe_parquet(path: str, what: str, size: int) -> Shard:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{what}: shard {path!r} is not valid parquet: {first_line(e)}") from None
    if meta.num_rows == 0:
        raise DataError(f"{what}: shard {path!r} is empty (0 rows)")
    names = list(schema.names)
    if "translation" in names and hasattr(schema.field("translation").type, "num_fields"):
        struct = schema.field("translation").type
        names = [struct.field(i).name for i in range(struct.num_fields)]
    groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return Shard(path, "parquet", size, tuple(sorted(names)), row_groups=groups, records=meta.num_rows)


# ----------------------------------------------------------------------------- pieces


def split_pieces(shards: Sequence[Shard], piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """Each shard cut into pieces (see the module docstring); equal byte ranges per plain shard."""
    pieces: list[Piece] = []
    for i, shard in enumerate(shards):
        if shard.kind == "jsonl" and shard.size > piece_bytes:
            n = -(-shard.size // piece_bytes)
            bounds = [shard.size * k // n for k in range(n + 1)]
            pieces.extend(Piece(i, a, b) for a, b in zip(bounds, bounds[1:]))
        elif shard.kind == "parquet":
            pieces.extend(Piece(i, g, g + 1) for g, rows in enumerate(shard.row_groups) if rows)
        else:
            pieces.append(Piece(i))
    return pieces


# ----------------------------------------------------------------------------- reading


def _open_binary(path: str, kind: str) -> Any:
    return gzip.open(path, "rb") if kind.endswith(".gz") or path.endswith(".gz") else open(path, "rb")


def _record(raw: bytes) -> Record | str:
    """A JSON line -> `{lang: text}` (the `translation` dict, or the flat object), or why it is bad."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    inner = obj.get("translation")
    return inner if isinstance(inner, dict) else obj


@dataclass
class PieceReader:
    """Records of one piece in order, from a saved position; bad lines skipped and counted.

    Iterating yields `{lang: text}` dicts (a language may be absent or None: the caller counts
    missing sides). `position()` after any record is where `PieceReader(.., position)` resumes.
    `finish()` applies `max_bad_record_fraction` to the piece and returns its `BadLines`.
    """

    shard: Shard
    piece: Piece
    max_bad: float
    start: int = 0  # the saved position: byte offset (plain; 0 = the piece's start), row or line count
    bad: BadLines = field(init=False)
    _pos: int = field(init=False)

    def __post_init__(self) -> None:
        self.bad = BadLines("shard", self.shard.path)
        self._pos = self.start

    def position(self) -> int:
        return self._pos

    def __iter__(self) -> Iterator[Record]:
        kind = self.shard.kind
        try:
            if kind == "jsonl":
                yield from self._plain_lines()
            elif kind == "parquet":
                yield from self._parquet_rows()
            elif kind == "text":
                yield from self._text_lines()
            else:
                yield from self._gzip_lines()
        except (OSError, EOFError) as e:  # truncated gzip, a file removed mid-run
            raise DataError(f"cannot read shard {self.shard.path!r}: {first_line(e)}") from None

    def _bad_line(self, line_no: int | None, offset: int, why: str) -> None:
        """Count a bad line; the first few are named by their line in the shard (counted lazily)."""
        if len(self.bad.examples) < BadLines.EXAMPLES and line_no is None:
            line_no = _line_number(self.shard.path, offset)
        self.bad.add(line_no or 0, why)

    def _plain_lines(self) -> Iterator[Record]:
        end = self.shard.size if self.piece.end < 0 else self.piece.end
        with open(self.shard.path, "rb") as f:
            pos = self.start or self.piece.start
            if pos > 0 and not self.start:  # a line belongs to the piece where it starts
                f.seek(pos - 1)
                pos += len(f.readline()) - 1
            f.seek(pos)
            while pos < end:
                raw = f.readline()
                if not raw:
                    break
                line_start, pos = pos, pos + len(raw)
                self._pos = pos
                if not raw.strip():
                    continue
                self.bad.lines += 1
                rec = _record(raw)
                if isinstance(rec, str):
                    self._bad_line(None, line_start, rec)
                    continue
                yield rec

    def _gzip_lines(self) -> Iterator[Record]:
        with gzip.open(self.shard.path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if line_no <= self.start:
                    continue
                self._pos = line_no
                if not raw.strip():
                    continue
                self.bad.lines += 1
                rec = _record(raw)
                if isinstance(rec, str):
                    self._bad_line(line_no, 0, rec)
                    continue
                yield rec

    def _text_lines(self) -> Iterator[Record]:
        files = dict(self.shard.files)
        handles = [_open_binary(p, "") for p in files.values()]
        try:
            line_no = 0
            while True:
                raws = [h.readline() for h in handles]
                if not any(raws):
                    return
                line_no += 1
                if not all(raws):
                    ended = [p for p, r in zip(files.values(), raws) if not r]
                    raise DataError(
                        f"text shard {self.shard.path!r}: {ended} end(s) at line {line_no - 1} while the "
                        f"other language file(s) go on: the files are not line-aligned"
                    )
                if line_no <= self.start:
                    continue
                self._pos = line_no
                self.bad.lines += 1
                try:
                    yield {lang: r.decode("utf-8").rstrip("\r\n") for lang, r in zip(files, raws)}
                except UnicodeDecodeError as e:
                    self._bad_line(line_no, 0, f"not UTF-8 ({first_line(e)})")
        finally:
            for h in handles:
                h.close()

    def _parquet_rows(self) -> Iterator[Record]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.shard.path)
        groups = list(range(self.piece.start, self.piece.end))
        row = 0
        for batch in pf.iter_batches(batch_size=1024, row_groups=groups):
            for rec in batch.to_pylist():
                row += 1
                if row <= self.start:
                    continue
                self._pos = row
                self.bad.lines += 1
                inner = rec.get("translation")
                yield inner if isinstance(inner, dict) else rec

    def finish(self) -> BadLines:
        """The piece's bad lines, after checking them against `max_bad_record_fraction`.

        Raises:
            DataError: more than that share of the piece's lines are unreadable, naming the first.
        """
        if self.bad.lines and self.bad.bad:
            self.bad.check(self.max_bad)
        return self.bad


def _line_number(path: str, offset: int) -> int:
    """The 1-based line of a plain file that starts at byte `offset` (one pass over the bytes before it)."""
    count, left = 1, offset
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            count += block.count(b"\n")
            left -= len(block)
    return count


def shard_languages(shards: Sequence[Shard]) -> list[str]:
    """Every language some shard holds, sorted (for messages)."""
    return sorted({lang for s in shards for lang in s.languages})


def fingerprint(shards: Sequence[Shard]) -> str:
    """What identifies the corpus in a data state: paths and sizes (a changed corpus is a different run)."""
    import hashlib

    text = json.dumps([(s.path, s.size) for s in shards])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
