"""One language under its several codes: M2M100's (`en`, ISO 639-1 or -3) and NLLB / FLORES-200's
(`eng_Latn`, ISO 639-3 and an ISO 15924 script), matched through the tables of packages the
project already has, not a table of its own:

    pycountry   ISO 639-3 -> ISO 639-1 (`eng` -> `en`, `ces` -> `cs`, `tgl` -> `tl`)
    babel       CLDR's language aliases, which also take an individual language to its
                macrolanguage (`arb` -> `ar`, `zsm` -> `ms`, `pes` -> `fa`, `swh` -> `sw`,
                `prs` -> `fa_AF`: a regional variant), and its likely scripts (`zh` -> Hans,
                `sr` -> Cyrl), which pick `zho_Hans` over `zho_Hant` for `zh`

`code_key` reduces a code to (language, script, variant); `matching_codes` finds a code's
counterparts in a list (the model's tags, the files of a FLORES directory). Of stock M2M100's
100 codes, 94 find their FLORES-200 code this way (`fa`: `pes_Arab`, not the variant
`prs_Arab`); `br` and `fy` have none in FLORES-200, and `ff` (`fuv_Latn`), `no` (`nob_Latn`),
`ns` (`nso_Latn`) and `ps` (`pbt_Arab`) are related by no table here: name those files by the
model's code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache

from trainer.tokenizer.vocab import NLLB_CODE


@dataclass(frozen=True)
class CodeKey:
    """What a code says: its language (ISO 639-1 where one exists), script, and whether it is a
    regional or script variant of that language (CLDR aliases such as `prs` -> `fa_AF`)."""

    language: str
    script: str | None
    variant: bool


@cache
def _cldr() -> tuple[Mapping[str, str], Mapping[str, str]]:
    """CLDR's language aliases and likely subtags (`zh` -> `zh_Hans_CN`), as babel ships them."""
    from babel.core import get_global

    return get_global("language_aliases"), get_global("likely_subtags")


def _language(subtag: str) -> tuple[str, bool]:
    """A language subtag in its shortest ISO form, following ISO 639-3 -> 639-1 and CLDR's aliases
    to a fixed point; and whether an alias named a variant (more than a language)."""
    import pycountry

    lang, variant, seen = subtag.lower(), False, set()
    while lang not in seen:
        seen.add(lang)
        entry = pycountry.languages.get(alpha_3=lang) if len(lang) == 3 else None
        lang = getattr(entry, "alpha_2", lang)
        alias = _cldr()[0].get(lang)
        if alias:
            lang, *rest = alias.split("_")
            variant = variant or bool(rest)
    return lang, variant


@cache
def code_key(code: str) -> CodeKey:
    """`eng_Latn` -> (en, Latn); `en` -> (en, Latn, its likely script); `prs_Arab` -> (fa, Arab, variant)."""
    if NLLB_CODE.fullmatch(code):
        subtag, script = code.split("_")
        lang, variant = _language(subtag)
        return CodeKey(lang, script, variant)
    lang, variant = _language(code.split("_")[0].split("-")[0])
    likely = _cldr()[1].get(lang)  # e.g. "zh_Hans_CN"
    return CodeKey(lang, likely.split("_")[1] if likely else None, variant)


def matching_codes(code: str, candidates: Iterable[str]) -> list[str]:
    """The codes of `candidates` naming `code`'s language, best first: `code` itself if there;
    else those of its language, narrowed where several to those of its script, then to those
    that are not a variant. Several left: ambiguous (the caller says so); none: unrelated."""
    options = list(dict.fromkeys(candidates))
    if code in options:
        return [code]
    key = code_key(code)
    same = [c for c in options if code_key(c).language == key.language]
    for prefer in (lambda k: k.script == key.script, lambda k: not k.variant):
        narrowed = [c for c in same if prefer(code_key(c))]
        if len(same) > 1 and narrowed:
            same = narrowed
    return same
