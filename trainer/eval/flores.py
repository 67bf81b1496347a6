"""A FLORES-style evaluation set: one file per language, line i of every file the same sentence.

    DIR/devtest/eng_Latn.devtest   FLORES-200's layout (`--data_dir DIR`, found by default)
    DIR/eng_Latn.devtest           or DIR/dev/eng_Latn.dev, DIR/eng_Latn.dev
    DIR/en.txt                     any other layout: `--file_pattern '{lang}.txt'`

`resolve_pattern` finds the file name pattern, `parse_directions` the directions asked for
(a list, or every ordered pair of some languages), and `read_language_files` reads and checks
the files. A language's file is the one named by its code, else the one whose code names the
same language (`find_file`, through `trainer.tokenizer.lang_codes`): `--languages en de` reads
FLORES-200's `eng_Latn.devtest` and `deu_Latn.devtest`, and `eng_Latn` would read `en.txt`.
Everything here is pure (no torch, no process group), so `python -m trainer.evaluate` fails on
bad input in one line, on every rank alike, before any work.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from trainer.errors import BadInputError
from trainer.tokenizer.lang_codes import matching_codes

# Tried in order under --data_dir when no --file_pattern is given: FLORES-200's devtest, then dev.
DEFAULT_PATTERNS = ("{lang}.devtest", "devtest/{lang}.devtest", "{lang}.dev", "dev/{lang}.dev")


class EvaluateError(BadInputError):
    """Bad input to `python -m trainer.evaluate`; the message names the bad value and what is valid."""


def parse_directions(
    directions: Sequence[str] | None, languages: Sequence[str] | None
) -> list[tuple[str, str]]:
    """The directions to score: `directions` as given (`en-de`), or every ordered pair of `languages`.

    Args:
        directions: `src-tgt` strings (language codes as the model's tags: `en`, `eng_Latn`).
        languages: two or more codes; all pairs in both directions, in the order given.

    Returns:
        (src, tgt) pairs, in order, each once.

    Raises:
        EvaluateError: neither or both given, a malformed direction, a language to itself, or
            fewer than two languages.
    """
    if bool(directions) == bool(languages):
        raise EvaluateError(
            "give the directions to score: --directions en-de de-en ..., or --languages en de fr "
            "(every pair of them); " + ("not both" if directions else "neither was given")
        )
    if languages:
        langs = list(dict.fromkeys(languages))
        if len(langs) < 2:
            raise EvaluateError(f"--languages {' '.join(languages)}: give two or more different languages")
        return [(s, t) for s in langs for t in langs if s != t]
    out: list[tuple[str, str]] = []
    for d in directions or []:
        parts = d.split("-")
        if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
            raise EvaluateError(
                f"--directions: {d!r} is not a direction; write SRC-TGT with two different language "
                "codes, e.g. en-de or eng_Latn-deu_Latn"
            )
        if (parts[0], parts[1]) not in out:
            out.append((parts[0], parts[1]))
    return out


def languages_of(directions: Sequence[tuple[str, str]]) -> list[str]:
    """Every language of `directions`, in first-seen order."""
    return list(dict.fromkeys(lang for pair in directions for lang in pair))


def resolve_pattern(data_dir: str | Path, pattern: str | None, languages: Sequence[str]) -> str:
    """The file name pattern (relative to `data_dir`, with `{lang}`) the language files follow.

    Args:
        data_dir: the directory of the evaluation set.
        pattern: `--file_pattern`; None: the first of `DEFAULT_PATTERNS` under which the first
            language's file exists.
        languages: the languages to read.

    Raises:
        EvaluateError: `data_dir` is not a directory, `pattern` lacks `{lang}`, or no default
            pattern names an existing file.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise EvaluateError(f"--data_dir {str(data_dir)!r} is not a directory")
    if pattern is not None:
        if "{lang}" not in pattern:
            raise EvaluateError(
                f"--file_pattern {pattern!r} has no {{lang}}; e.g. '{{lang}}.devtest' or 'test.{{lang}}'"
            )
        return pattern
    for candidate in DEFAULT_PATTERNS:
        if find_file(root, candidate, languages[0]) is not None:
            return candidate
    tried = ", ".join(p.format(lang=languages[0]) for p in DEFAULT_PATTERNS)
    raise EvaluateError(
        f"no file for language {languages[0]!r} in {str(root)!r} (tried {tried}); name the files' "
        "layout with --file_pattern, e.g. '{lang}.txt'"
    )


def file_codes(root: Path, pattern: str) -> list[str]:
    """The language codes of the files under `root` that follow `pattern` (`{lang}` in it), sorted."""
    head, _, tail = pattern.partition("{lang}")
    shape = re.compile(re.escape(head) + r"([^/]+)" + re.escape(tail))
    found = (
        shape.fullmatch(p.relative_to(root).as_posix()) for p in root.glob(pattern.replace("{lang}", "*"))
    )
    return sorted(m.group(1) for m in found if m is not None)


def find_file(root: Path, pattern: str, lang: str) -> str | None:
    """The code `lang`'s file goes by under `root`: `lang` itself, else the one file code of the
    same language (`en` -> `eng_Latn`, `eng_Latn` -> `en`); None if there is none.

    Raises:
        EvaluateError: several files could be `lang`'s (the user then names one by its code).
    """
    if (root / pattern.format(lang=lang)).is_file():
        return lang
    found = matching_codes(lang, file_codes(root, pattern))
    if len(found) > 1:
        raise EvaluateError(
            f"language {lang!r}: several files could be its file ({', '.join(pattern.format(lang=c) for c in found)}); "
            f"name the one to score by its code, e.g. {found[0]}"
        )
    return found[0] if found else None


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file, split on '\\n' only.

    `str.splitlines` would also split inside a sentence on U+2028, U+0085, form feeds, ...,
    which occur in real multilingual text and would shift every later line of that language.
    """
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return [line.removesuffix("\r") for line in lines]


def read_language_files(
    data_dir: str | Path, pattern: str, languages: Sequence[str], max_samples: int | None = None
) -> dict[str, list[str]]:
    """Every language's sentences, checked to be line-aligned.

    Args:
        data_dir, pattern: the files are `data_dir / pattern.format(lang=...)`.
        languages: the languages to read.
        max_samples: keep the first this many lines of each (None: all).

    Returns:
        language -> its lines, all of one length (a language's file: `find_file`'s).

    Raises:
        EvaluateError: a missing or empty file, files of different line counts, max_samples < 1.
    """
    if max_samples is not None and max_samples < 1:
        raise EvaluateError(f"--max_samples {max_samples} must be >= 1")
    root = Path(data_dir)
    texts: dict[str, list[str]] = {}
    names: dict[str, str] = {}
    for lang in languages:
        code = find_file(root, pattern, lang)
        names[lang] = pattern.format(lang=code or lang)
        path = root / names[lang]
        if code is None:
            raise EvaluateError(
                f"no file for language {lang!r}: {str(path)!r} does not exist, nor one under another code "
                f"of that language (--data_dir {str(root)!r}, --file_pattern {pattern!r})"
            )
        try:
            texts[lang] = read_lines(path)
        except UnicodeDecodeError as e:
            raise EvaluateError(f"{str(path)!r} is not UTF-8 text: {e}") from None
        if not texts[lang]:
            raise EvaluateError(f"{str(path)!r} ({lang}) has no lines")
    counts = {lang: len(lines) for lang, lines in texts.items()}
    if len(set(counts.values())) > 1:
        first = languages[0]
        other = next(lang for lang in languages if counts[lang] != counts[first])
        raise EvaluateError(
            f"the language files are not line-aligned: {names[first]} has {counts[first]} "
            f"lines but {names[other]} has {counts[other]} (line i of every file must be "
            "the same sentence)"
        )
    if max_samples is not None:
        texts = {lang: lines[:max_samples] for lang, lines in texts.items()}
    return texts
