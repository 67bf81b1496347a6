"""The built-in corpus: real multilingual text, deterministic, split by item, fast."""

from __future__ import annotations

import pytest

from trainer.data.corpus import (
    CorpusError,
    build_builtin_corpus,
    cached_builtin_corpus,
    split_of,
    to_hf_dataset,
)

LANGS = ["en", "de", "fr", "es", "it", "pt", "ru", "ja"]


@pytest.fixture(scope="module")
def corpus() -> dict[str, list[dict[str, str]]]:
    return build_builtin_corpus(LANGS, 4000, seed=0)


def test_sized(corpus: dict[str, list[dict[str, str]]]) -> None:
    # Its speed is not asserted here (a timed assertion fails on a loaded machine, not on slow code).
    assert sum(len(v) for v in corpus.values()) == 4000
    assert len(corpus["train"]) > 3000 and len(corpus["validation"]) > 100 and len(corpus["test"]) > 100


def test_every_item_in_every_language(corpus: dict[str, list[dict[str, str]]]) -> None:
    for record in corpus["train"][:500]:
        assert sorted(record) == sorted(LANGS)
        assert all(text.strip() == text and text for text in record.values())


def test_real_text_in_each_language(corpus: dict[str, list[dict[str, str]]]) -> None:
    texts = {lang: {r[lang] for r in corpus["train"]} for lang in LANGS}
    assert any("thousand" in t for t in texts["en"])
    assert any("tausend" in t for t in texts["de"])
    assert any("mille" in t for t in texts["fr"])
    assert any("тысяч" in t for t in texts["ru"])
    assert any("年" in t for t in texts["ja"])
    assert "Deutschland" in texts["de"] or any("Deutschland" in t for t in texts["de"])


def test_deterministic_and_seeded(corpus: dict[str, list[dict[str, str]]]) -> None:
    assert build_builtin_corpus(LANGS, 4000, seed=0) == corpus
    assert build_builtin_corpus(LANGS, 4000, seed=1) != corpus


def test_splits_disjoint_and_stable_across_seeds(corpus: dict[str, list[dict[str, str]]]) -> None:
    keys = {s: {r["en"] + "|" + r["de"] for r in recs} for s, recs in corpus.items()}
    assert not keys["train"] & keys["validation"]
    assert not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]
    other = build_builtin_corpus(LANGS, 4000, seed=7)
    other_keys = {s: {r["en"] + "|" + r["de"] for r in recs} for s, recs in other.items()}
    assert not other_keys["train"] & keys["validation"]  # an item never crosses splits
    assert split_of("cardinal:12") == split_of("cardinal:12")


def test_no_exact_duplicates(corpus: dict[str, list[dict[str, str]]]) -> None:
    rows = [tuple(r[lang] for lang in LANGS) for recs in corpus.values() for r in recs]
    assert len(rows) == len(set(rows))


def test_hf_format() -> None:
    ds = to_hf_dataset(build_builtin_corpus(["en", "cs"], 50, seed=0)["train"])
    assert ds.column_names == ["translation"]
    assert set(ds[0]["translation"]) == {"en", "cs"}


def test_unsupported_language_is_named() -> None:
    with pytest.raises(CorpusError, match=r"\['xx'\].*supported"):
        build_builtin_corpus(["en", "xx"], 10, seed=0)


def test_cached_corpus_is_the_built_one_read_back(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's ranks and later runs read the corpus back (trainer/data/sources.py keeps it in the
    datasets cache); other arguments are another file, and a damaged file is rebuilt."""
    from trainer.data import corpus as corpus_module

    built = build_builtin_corpus(["en", "de"], 300, seed=3)
    assert cached_builtin_corpus(["en", "de"], 300, 3, tmp_path) == built
    [kept] = tmp_path.glob("builtin-*.json")
    monkeypatch.setattr(
        corpus_module, "build_builtin_corpus", lambda *a: pytest.fail("rebuilt a kept corpus")
    )
    assert cached_builtin_corpus(["en", "de"], 300, 3, tmp_path) == built
    monkeypatch.undo()
    assert cached_builtin_corpus(["en", "de"], 300, 4, tmp_path) != built  # another seed: another file
    assert len(list(tmp_path.glob("builtin-*.json"))) == 2
    for damaged in ('{"train": [', '["train"]', '{"train": []}'):  # not this code's (it renames whole files)
        kept.write_text(damaged)
        assert cached_builtin_corpus(["en", "de"], 300, 3, tmp_path) == built
    assert cached_builtin_corpus(["en", "de"], 300, 3, None) == built  # no cache: built each time
    assert not list(tmp_path.glob("*.tmp"))
