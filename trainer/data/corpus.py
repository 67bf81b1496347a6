"""The built-in multilingual parallel corpus (`dataset_name: builtin`), generated offline.

Every *item* is a concept (a number, a date, a country, an amount of money, ...)
rendered in every language of the run from data that ships inside Python packages:

    num2words          cardinals, ordinals and years in words
    babel (CLDR)       dates in several formats, territory / language / currency names,
                       currency amounts, measurement units, locale-aware lists
    pycountry          the ISO 3166 / 639 / 4217 code lists the CLDR names are drawn for

so one item gives a translation pair for any direction (many-to-many). The corpus is
deterministic given `(languages, size, seed)`; each item goes to train / validation /
test by a stable hash of its key, so an item never crosses splits whatever the seed or
size. Records whose texts are all equal to an earlier record are dropped (exact dedupe).
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import babel
import babel.dates
import babel.lists
import babel.numbers
import babel.units
import pycountry
from num2words import num2words

from trainer.errors import BadInputError

SPLITS = ("train", "validation", "test")
# Languages every generator below renders (num2words x CLDR); other kinds fall away per run.
SUPPORTED_LANGUAGES = (
    "cs", "da", "de", "en", "es", "fi", "fr", "hu", "id", "it",
    "ja", "ko", "nl", "pl", "pt", "ro", "ru", "sv", "tr", "uk",
)  # fmt: skip
DATE_FORMATS = ("full", "long", "medium")
UNITS = (
    "length-kilometer", "length-meter", "mass-kilogram", "volume-liter", "temperature-celsius",
    "speed-kilometer-per-hour", "area-square-meter", "digital-gigabyte", "duration-hour",
    "duration-day", "duration-week", "duration-month", "duration-year", "duration-minute",
)  # fmt: skip
_VALIDATION_PERMILLE = 50  # 5% of the hash space
_TEST_PERMILLE = 50

Record = dict[str, str]
_TABLES = {"territory": "territories", "language": "languages", "currency": "currencies"}


class CorpusError(BadInputError):
    """The built-in corpus cannot be built as asked; the message names the bad value."""


@dataclass(frozen=True)
class Item:
    """One concept: `kind` selects the renderer, `args` its parameters; `key` is its identity."""

    kind: str
    args: tuple[object, ...]

    @property
    def key(self) -> str:
        return self.kind + ":" + ",".join(str(a) for a in self.args)


# ----------------------------------------------------------------------------- cached CLDR data


class Unrenderable(LookupError):
    """A package cannot render this item in this language (the item is skipped)."""


@functools.cache
def _locale(lang: str) -> babel.Locale:
    return babel.Locale.parse(lang)


@functools.cache
def _common_codes(kind: str, languages: tuple[str, ...]) -> tuple[str, ...]:
    """ISO codes (pycountry) whose CLDR name exists in every language, sorted."""
    if kind == "territory":
        iso = {c.alpha_2 for c in pycountry.countries}
    elif kind == "language":
        iso = {lang.alpha_2 for lang in pycountry.languages if hasattr(lang, "alpha_2")}
    else:
        iso = {c.alpha_3 for c in pycountry.currencies}
    for lang in languages:
        iso &= set(getattr(_locale(lang), _TABLES[kind]))
    return tuple(sorted(iso))


@functools.cache
def _common_units(languages: tuple[str, ...]) -> tuple[str, ...]:
    """The CLDR units with a long name in every language."""
    units = []
    for unit in UNITS:
        try:
            for lang in languages:
                _render_unit(2, unit, lang)
        except (Unrenderable, NotImplementedError, KeyError, ValueError):
            continue
        units.append(unit)
    return tuple(units) or ("length-kilometer",)


def _name(kind: str, code: str, lang: str) -> str:
    return str(getattr(_locale(lang), _TABLES[kind])[code])


# ----------------------------------------------------------------------------- renderers


def _words(n: int, lang: str, to: str = "cardinal") -> str:
    text = num2words(n, lang=lang, to=to)
    if not isinstance(text, str):  # some languages return the number itself when unsupported
        raise Unrenderable(f"num2words to={to} for {lang}")
    return text


def _render_unit(value: int, unit: str, lang: str) -> str:
    text = str(babel.units.format_unit(value, unit, length="long", locale=lang))
    if unit in text:  # CLDR lacks this unit in `lang`: babel falls back to the unit id
        raise Unrenderable(f"unit {unit} in {lang}")
    return text


def _render_count_currency(n: int, code: str, lang: str) -> str:
    joiner = "" if lang == "ja" else " "
    return _words(n, lang) + joiner + babel.numbers.get_currency_name(code, count=n, locale=lang)


def _render_list(kind: str, codes: tuple[str, ...], lang: str) -> str:
    return babel.lists.format_list([_name(kind, c, lang) for c in codes], locale=lang)


RENDERERS: dict[str, Callable[..., str]] = {
    "cardinal": lambda lang, n: _words(n, lang),
    "ordinal": lambda lang, n: _words(n, lang, "ordinal"),
    "year": lambda lang, y: _words(y, lang, "year"),
    "date": lambda lang, iso, fmt: babel.dates.format_date(dt.date.fromisoformat(iso), fmt, locale=lang),
    "territory": lambda lang, code: _name("territory", code, lang),
    "language": lambda lang, code: _name("language", code, lang),
    "currency": lambda lang, code: _name("currency", code, lang),
    "money": lambda lang, cents, code: babel.numbers.format_currency(cents / 100, code, locale=lang),
    "count_currency": lambda lang, n, code: _render_count_currency(n, code, lang),
    "unit": lambda lang, value, unit: _render_unit(value, unit, lang),
    "territory_list": lambda lang, *codes: _render_list("territory", codes, lang),
}
# Relative draw frequency of each kind (names are scarce: a few hundred per kind).
WEIGHTS = {
    "cardinal": 6, "ordinal": 2, "year": 2, "date": 5, "territory": 1, "language": 1, "currency": 1,
    "money": 3, "count_currency": 3, "unit": 3, "territory_list": 3,
}  # fmt: skip


def render(item: Item, languages: Sequence[str]) -> Record:
    """Render one item in every language.

    Args:
        item: the concept.
        languages: language codes.

    Returns:
        `{lang: text}` for every language.

    Raises:
        Unrenderable, NotImplementedError (num2words), KeyError, ValueError, AttributeError: a package
            cannot render it.
    """
    return {lang: RENDERERS[item.kind](lang, *item.args).strip() for lang in languages}


# ----------------------------------------------------------------------------- sampling


def _draw_number(rng: random.Random) -> int:
    return rng.choice((rng.randrange(0, 100), rng.randrange(100, 10_000), rng.randrange(10_000, 10_000_000)))


def _draw_date(rng: random.Random) -> str:
    return (dt.date(1900, 1, 1) + dt.timedelta(days=rng.randrange(0, 200 * 365))).isoformat()


def draw_item(kind: str, rng: random.Random, languages: tuple[str, ...]) -> Item:
    """Draw the parameters of one item of `kind`."""
    if kind == "cardinal":
        return Item(kind, (_draw_number(rng),))
    if kind == "ordinal":
        return Item(kind, (rng.randrange(1, 1000),))
    if kind == "year":
        return Item(kind, (rng.randrange(1000, 2100),))
    if kind == "date":
        return Item(kind, (_draw_date(rng), rng.choice(DATE_FORMATS)))
    if kind in ("territory", "language", "currency"):
        return Item(kind, (rng.choice(_common_codes(kind, languages)),))
    if kind == "money":
        return Item(kind, (rng.randrange(1, 10_000_000), rng.choice(_common_codes("currency", languages))))
    if kind == "count_currency":
        return Item(kind, (rng.randrange(1, 1000), rng.choice(_common_codes("currency", languages))))
    if kind == "unit":
        return Item(kind, (rng.randrange(0, 1000), rng.choice(_common_units(languages))))
    codes = _common_codes("territory", languages)
    return Item(kind, tuple(sorted(rng.sample(codes, rng.choice((2, 3))))))


@functools.cache
def supported_kinds(languages: tuple[str, ...]) -> tuple[str, ...]:
    """The item kinds every language of `languages` can render (probed once on sample items)."""
    rng = random.Random(0)
    kinds = []
    for kind in sorted(RENDERERS):
        try:
            for _ in range(3):
                render(draw_item(kind, rng, languages), languages)
        except (Unrenderable, NotImplementedError, KeyError, ValueError, AttributeError, TypeError):
            continue
        kinds.append(kind)
    return tuple(kinds)


def split_of(item_key: str) -> str:
    """The split an item belongs to, from a stable hash of its key (never Python's `hash`)."""
    permille = int.from_bytes(hashlib.sha1(item_key.encode()).digest()[:4], "big") % 1000
    if permille < _VALIDATION_PERMILLE:
        return "validation"
    if permille < _VALIDATION_PERMILLE + _TEST_PERMILLE:
        return "test"
    return "train"


def _check_languages(languages: Sequence[str]) -> tuple[str, ...]:
    langs = tuple(sorted(set(languages)))
    bad = [lang for lang in langs if lang not in SUPPORTED_LANGUAGES]
    if bad or not langs:
        raise CorpusError(
            f"builtin corpus cannot render language(s) {bad or '(none given)'}; "
            f"supported: {list(SUPPORTED_LANGUAGES)}"
        )
    return langs


def build_builtin_corpus(languages: Sequence[str], size: int, seed: int) -> dict[str, list[Record]]:
    """Generate the corpus: `size` distinct items, each rendered in every language.

    Args:
        languages: language codes, each in `SUPPORTED_LANGUAGES`.
        size: number of items over all splits (about 90% train, 5% validation, 5% test).
        seed: seed of the item draw.

    Returns:
        `{"train": [...], "validation": [...], "test": [...]}`, each a list of `{lang: text}`.

    Raises:
        CorpusError: on an unsupported language or a size below 1.
    """
    langs = _check_languages(languages)
    if size < 1:
        raise CorpusError(f"builtin_size={size} must be >= 1")
    kinds = supported_kinds(langs)
    weights = [WEIGHTS[k] for k in kinds]
    rng = random.Random(f"builtin-corpus-{seed}")
    out: dict[str, list[Record]] = {s: [] for s in SPLITS}
    seen_keys: set[str] = set()
    seen_texts: set[tuple[str, ...]] = set()
    attempts = 0
    while len(seen_keys) < size and attempts < 50 * size:
        attempts += 1
        item = draw_item(rng.choices(kinds, weights)[0], rng, langs)
        if item.key in seen_keys:
            continue
        try:
            record = render(item, langs)
        except (Unrenderable, NotImplementedError, KeyError, ValueError, AttributeError, TypeError):
            continue
        texts = tuple(record[lang] for lang in langs)
        if texts in seen_texts or not all(texts):
            continue
        seen_keys.add(item.key)
        seen_texts.add(texts)
        out[split_of(item.key)].append(record)
    return out


def cached_builtin_corpus(
    languages: Sequence[str], size: int, seed: int, cache_dir: Path | None
) -> dict[str, list[Record]]:
    """`build_builtin_corpus`, kept as JSON in `cache_dir` (None: not kept), as `datasets` keeps a
    downloaded corpus: a run's ranks and later runs read it back instead of rendering it again (a
    second of CPU per rank at 1,500 items). The key holds the arguments, this module's source and the
    versions of the packages that render the texts, so a change of any of them builds anew; the file
    appears whole (written aside, then renamed), so ranks building it at once cannot tear it."""
    if cache_dir is None:
        return build_builtin_corpus(languages, size, seed)
    versions = [metadata.version(p) for p in ("num2words", "babel", "pycountry")]
    key = json.dumps(
        [list(languages), size, seed, versions, hashlib.sha256(Path(__file__).read_bytes()).hexdigest()]
    )
    path = cache_dir / f"builtin-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(kept, dict) and all(isinstance(kept.get(s), list) for s in SPLITS):
            return kept
    except (OSError, ValueError):
        pass  # not there yet (or unreadable): build it
    corpus = build_builtin_corpus(languages, size, seed)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(corpus, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the corpus is rebuilt next time
    return corpus


def to_hf_dataset(records: Sequence[Record]):  # -> datasets.Dataset (imported lazily)
    """Records in the Hugging Face translation format: one row `{"translation": {lang: text}}`.

    Args:
        records: `{lang: text}` dicts, all with the same languages.

    Returns:
        A `datasets.Dataset` with a single `translation` column.
    """
    import datasets

    return datasets.Dataset.from_dict({"translation": list(records)})
