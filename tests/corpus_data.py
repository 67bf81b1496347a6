"""The tests' parallel text in multi30k's layout, on any machine.

Tests that want sentences read `train.{lang}.gz` and `val.{lang}.gz` (UTF-8, one sentence a line,
line i of every language aligned; cs, de, en, fr) from the `multi30k` fixture (tests/conftest.py),
a folder that is the first of:

1. `MULTI30K_DIR`, if set: a folder of those files, or `generate` for 3;
2. multi30k beside the clone (`../shared/data/multi30k`, where CI keeps it): real captions;
3. the built-in corpus (trainer/data/corpus.py: numbers, dates and CLDR names, generated offline)
   written in that layout, once per session, under pytest's temporary directory.

multi30k's licence ("for research use") does not clearly allow redistribution, so no copy is in the
repository; where it comes from: scripts/make_sharded_corpus.py's MULTI30K_SOURCE. Every test
that reads this folder passes on either text (docs/development.md, "Test data").
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

from scripts.make_sharded_corpus import BESIDE_CLONE, MULTI30K_SOURCE

ENV = "MULTI30K_DIR"
GENERATE = "generate"
LANGUAGES = ("cs", "de", "en", "fr")
SPLITS = ("train", "val")
FILES = tuple(f"{split}.{lang}.gz" for split in SPLITS for lang in LANGUAGES)
# About 3,600 train and 400 val lines per language; the tests read at most 2,000 and 300.
GENERATED_ITEMS = 4000


def _missing(folder: Path) -> list[str]:
    return [name for name in FILES if not (folder / name).is_file()]


def found() -> Path | None:
    """The folder of real text to read, or None where the corpus is to be generated.

    Raises:
        pytest.UsageError: `MULTI30K_DIR` names a folder without the files (one line, at start-up).
    """
    value = os.environ.get(ENV, "")
    if value == GENERATE:
        return None
    if value:
        missing = _missing(Path(value))
        if missing:
            raise pytest.UsageError(
                f"{ENV}={value} has no {missing[0]}: set it to a folder of multi30k's "
                f"{{train,val}}.{{{','.join(LANGUAGES)}}}.gz ({MULTI30K_SOURCE}), or to '{GENERATE}' "
                "for the built-in corpus"
            )
        return Path(value)
    return None if _missing(BESIDE_CLONE) else BESIDE_CLONE


def describe() -> str:
    """Which text this session reads, for pytest's header."""
    real, value = found(), os.environ.get(ENV, "")
    if real is not None:
        return f"{real} ({ENV})" if value else f"{real} (beside the clone)"
    why = f"{ENV}={GENERATE}" if value else f"no {ENV}, none beside the clone"
    return f"the built-in corpus in multi30k's layout, generated ({why})"


def generate(out: Path) -> Path:
    """Write the built-in corpus (cs, de, en, fr) as multi30k's files in `out`; returns `out`.

    The corpus's validation and test items both go to `val` (an item never crosses splits).
    """
    from trainer.data.corpus import build_builtin_corpus

    corpus = build_builtin_corpus(LANGUAGES, GENERATED_ITEMS, seed=0)
    for split, records in (("train", corpus["train"]), ("val", corpus["validation"] + corpus["test"])):
        for lang in LANGUAGES:
            lines = [r[lang] for r in records]
            assert not any("\n" in line for line in lines), "a generated text holds a newline"
            with gzip.open(out / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    return out


def read_lines(folder: Path, split: str, lang: str, n: int) -> list[str]:
    """The first `n` lines of `{split}.{lang}.gz`, without their newline.

    Raises:
        AssertionError: the file has fewer lines (a test must not run on less text unnoticed).
    """
    with gzip.open(folder / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for _, line in zip(range(n), f)]
    assert len(lines) == n, f"{folder}/{split}.{lang}.gz has {len(lines)} lines, the test reads {n}"
    return lines
