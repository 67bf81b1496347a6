"""Data loading, filtering and mesh-independent global batches, on multi30k-layout text (`multi30k`)."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from models.m2m100 import IGNORE_INDEX
from tests.corpus_data import read_lines
from trainer.config.data_args import DataArguments
from trainer.data.batching import BatchLayout, GlobalBatchSampler, eval_batches
from trainer.data.sources import column_array, load_raw_datasets, load_test_pairs, training_texts
from trainer.data.tokenization import TranslationData, tokenize_datasets
from trainer.errors import ConfigError, DataError
from trainer.tokenizer.vocab import SentencePieceTokenizer, train_tokenizer

LANGS = ["cs", "de", "en", "fr"]
N = 1500


@pytest.fixture(scope="module")
def corpus(multi30k: Path) -> dict[str, dict[str, list[str]]]:
    return {split: {lang: read_lines(multi30k, split, lang, N if split == "train" else 200) for lang in LANGS}
            for split in ("train", "val")}  # fmt: skip


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory, corpus: dict[str, dict[str, list[str]]]) -> Path:
    d = tmp_path_factory.mktemp("text")
    for split, by_lang in corpus.items():
        for lang, lines in by_lang.items():
            with gzip.open(d / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    return d


@pytest.fixture(scope="module")
def tok(corpus: dict[str, dict[str, list[str]]]) -> SentencePieceTokenizer:
    return train_tokenizer([t for lines in corpus["train"].values() for t in lines], LANGS, 1000, seed=0)


def _args(**kw: object) -> DataArguments:
    return DataArguments(**kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def data(text_dir: Path, tok: SentencePieceTokenizer) -> TranslationData:
    args = _args(train_file=str(text_dir / "train.{lang}.gz"), validation_file=str(text_dir / "val.{lang}.gz"),
                 language_pairs=["en-de", "de-en", "en-fr"])  # fmt: skip
    return tokenize_datasets(load_raw_datasets(args, seed=0), tok, args)


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _records(corpus: dict[str, dict[str, list[str]]], n: int, langs: list[str]) -> list[dict[str, object]]:
    return [{"translation": {lang: corpus["train"][lang][i] for lang in langs}} for i in range(n)]


# ---------------------------------------------------------------------------------------------- formats


def test_text_files_and_directions(data: TranslationData) -> None:
    assert len(data.train) == 3 * N
    assert Counter(zip(data.train["src_lang"], data.train["tgt_lang"])) == {("en", "de"): N, ("de", "en"): N,
                                                                          ("en", "fr"): N}  # fmt: skip
    assert sorted(data.validation) == ["de-en", "en-de", "en-fr"]
    assert all(len(v) == 200 for v in data.validation.values())


def test_example_layout(data: TranslationData, tok: SentencePieceTokenizer, corpus: dict) -> None:
    ex = data.train[0]
    src, tgt = ex["src_lang"], ex["tgt_lang"]
    assert ex["input_ids"][0] == tok.lang_id(src) and ex["input_ids"][-1] == tok.eos_id
    assert ex["labels"][0] == tok.lang_id(tgt) and ex["labels"][-1] == tok.eos_id
    assert tok.decode(ex["input_ids"]) == corpus["train"][src][0]
    assert (ex["src_len"], ex["tgt_len"]) == (len(ex["input_ids"]), len(ex["labels"]))
    sampler = GlobalBatchSampler(data.train, BatchLayout(4), 0, tok.pad_id, tok.eos_id)
    batch = sampler._fetch(np.array([0, 1]))
    labels = batch.labels[0][batch.labels[0] != IGNORE_INDEX].tolist()
    assert labels == ex["labels"]
    assert batch.decoder_input_ids[0, : len(labels)].tolist() == [tok.eos_id, *labels[:-1]]  # </s> __tgt__ y
    assert batch.input_ids[0, : ex["src_len"]].tolist() == ex["input_ids"]
    assert int(batch.attention_mask[0].sum()) == ex["src_len"]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_jsonl_and_parquet(tmp_path: Path, corpus: dict, fmt: str) -> None:
    import datasets

    rows = _records(corpus, 50, ["en", "fr"])
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    if fmt == "parquet":
        path = tmp_path / "train.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    raw = load_raw_datasets(_args(train_file=str(path), validation_file=str(path), source_lang="en",
                                  target_lang="fr"), seed=0)  # fmt: skip
    assert len(raw.train) == 50 and raw.train[3]["target"] == corpus["train"]["fr"][3]
    assert len(raw.validation["en-fr"]) == 50


def test_a_run_without_evaluation_reads_but_does_not_pair_validation(tmp_path: Path, corpus: dict) -> None:
    """`validation=False` (trainer.run.data: no evaluation asked): no validation pairs to make or
    tokenize, and a bad validation file is still an error."""
    path = _write_jsonl(tmp_path / "train.jsonl", _records(corpus, 30, ["en", "de"]))
    args = _args(train_file=str(path), validation_file=str(path), source_lang="en", target_lang="de")
    raw = load_raw_datasets(args, 0, validation=False)
    assert len(raw.train) == 30 and raw.validation == {}
    assert len(load_raw_datasets(args, 0).validation["en-de"]) == 30
    args.validation_file = str(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="missing.jsonl"):
        load_raw_datasets(args, 0, validation=False)


def test_dataset_directory_and_builtin(tmp_path: Path, corpus: dict) -> None:
    _write_jsonl(tmp_path / "train.jsonl", _records(corpus, 40, ["en", "de"]))
    _write_jsonl(tmp_path / "validation.jsonl", _records(corpus, 10, ["en", "de"]))
    raw = load_raw_datasets(_args(dataset_name=str(tmp_path), source_lang="de", target_lang="en"), seed=0)
    assert len(raw.train) == 40 and len(raw.validation["de-en"]) == 10
    raw = load_raw_datasets(
        _args(dataset_name="builtin", builtin_size=300, language_pairs=["en-ja", "ru-es"]), 0
    )
    assert set(raw.train["src_lang"]) == {"en", "ru"} and len(raw.validation["en-ja"]) > 0


def test_test_split_of_a_dataset_directory(tmp_path: Path, corpus: dict) -> None:
    """do_predict's data without a test_file: the `test` split of dataset_name, whether a
    `save_to_disk` directory, a directory of data files or the builtin corpus; test_file wins.

    Every test line is kept, an empty side included (before, an empty text was skipped and
    max_eval_samples capped the test set, so generated_predictions.txt had fewer lines than the
    test file); only max_predict_samples caps it."""
    import datasets

    rows = _records(corpus, 60, ["en", "de"])
    rows[50]["translation"]["de"] = " "  # an empty side: still translated (one prediction per line)
    splits = {"train": rows[:40], "validation": rows[40:48], "test": rows[48:60]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "disk")
    )
    (tmp_path / "files").mkdir()
    for split, part in splits.items():
        _write_jsonl(tmp_path / "files" / f"{split}.jsonl", part)
    for where in ("disk", "files"):
        args = _args(
            dataset_name=str(tmp_path / where), language_pairs=["en-de", "de-en"], max_eval_samples=10
        )
        test = load_test_pairs(args, seed=0)
        assert {k: len(v) for k, v in test.validation.items()} == {"en-de": 12, "de-en": 12}, where
        assert test.validation["en-de"][0]["source"] == corpus["train"]["en"][48]
        assert test.validation["de-en"][2]["source"] == " "
        assert test.skipped["test:de-en"]["empty_text"] == 0
        capped = load_test_pairs(_args(dataset_name=str(tmp_path / where), source_lang="en",
                                       target_lang="de", max_predict_samples=5), seed=0)  # fmt: skip
        assert len(capped.validation["en-de"]) == 5
    with_file = _args(dataset_name=str(tmp_path / "disk"), source_lang="en", target_lang="de",
                      test_file=str(tmp_path / "files" / "validation.jsonl"))  # fmt: skip
    assert len(load_test_pairs(with_file, seed=0).validation["en-de"]) == 8
    builtin = load_test_pairs(
        _args(dataset_name="builtin", builtin_size=300, source_lang="en", target_lang="fr"), 0
    )
    assert len(builtin.validation["en-fr"]) > 0
    (tmp_path / "files" / "test.jsonl").unlink()
    with pytest.raises(DataError, match=r"dataset_name='.*files' has no 'test' split for do_predict; it has "
                       r"\['train', 'validation'\] \(or set test_file\)"):  # fmt: skip
        load_test_pairs(_args(dataset_name=str(tmp_path / "files"), source_lang="en", target_lang="de"), 0)


# ---------------------------------------------------------------------------------------------- skips


def test_bad_records_are_counted(tmp_path: Path, corpus: dict, tok: SentencePieceTokenizer) -> None:
    """Missing sides and empty texts are skipped and counted. Over-long sides are truncated to
    max_source_length / max_target_length, tag and </s> kept, as run_translation.py does (before,
    they were skipped: under do_predict the predictions had fewer lines than the test file);
    skip_long_examples skips them instead."""
    rows = _records(corpus, 20, ["en", "de"])
    rows += [{"translation": {"en": "only english"}}, {"translation": {"en": "  ", "de": "leer"}},
             {"translation": {"en": "long " * 200, "de": "kurz"}}, {"translation": {"en": "short", "de": "lang " * 200}}]  # fmt: skip
    path = str(_write_jsonl(tmp_path / "t.jsonl", rows))
    args = _args(
        train_file=path, source_lang="en", target_lang="de", max_source_length=64, max_target_length=64
    )
    data = tokenize_datasets(load_raw_datasets(args, seed=0), tok, args)
    assert len(data.train) == 22
    assert data.skipped["train"] == {
        "unreadable_line": 0, "missing_side": 1, "empty_text": 1, "source_too_long": 0, "target_too_long": 0,
        "truncated_source": 1, "truncated_target": 1,
    }  # fmt: skip
    lengths = column_array(data.train, "src_len"), column_array(data.train, "tgt_len")
    assert max(lengths[0]) == 64 and max(lengths[1]) == 64
    cut = data.train.filter(lambda r: r["src_len"] == 64)[0]["input_ids"]
    assert cut[0] == tok.lang_id("en") and cut[-1] == tok.eos_id  # tag and </s> kept
    args = _args(train_file=path, source_lang="en", target_lang="de", max_source_length=64, max_target_length=64,
                 skip_long_examples=True)  # fmt: skip
    data = tokenize_datasets(load_raw_datasets(args, seed=0), tok, args)
    assert len(data.train) == 20
    assert data.skipped["train"] == {
        "unreadable_line": 0, "missing_side": 1, "empty_text": 1, "source_too_long": 1, "target_too_long": 1,
        "truncated_source": 0, "truncated_target": 0,
    }  # fmt: skip


def test_unreadable_lines_are_skipped_counted_and_named(
    tmp_path: Path, corpus: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: one malformed line in 300 failed the run ("is not valid json: Expected object or value at
    position 38", no line number); a non-UTF-8 byte raised a bare UnicodeDecodeError naming no file."""
    lines = [json.dumps(r, ensure_ascii=False) for r in _records(corpus, 300, ["en", "de"])]
    lines[150] = '{"translation": {"en": "torn'
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # a trailing blank line is no record
    with caplog.at_level("WARNING"):
        raw = load_raw_datasets(_args(train_file=str(path), validation_file=str(path), source_lang="en",
                                      target_lang="de"), seed=0)  # fmt: skip
    assert len(raw.train) == 299 and raw.train[150]["source"] == corpus["train"]["en"][151]
    assert (
        raw.skipped["train"]["unreadable_line"] == 1
        and raw.skipped["validation:en-de"]["unreadable_line"] == 1
    )
    assert (
        f"train_file '{path}': skipped 1 unreadable line(s) of 300 (line 151: not valid JSON" in caplog.text
    )

    raw_bytes = [line.encode() for line in lines[:40]]
    raw_bytes[20] = '{"translation": {"en": "café", "de": "x"}}'.encode("latin-1")
    path.write_bytes(b"\n".join(raw_bytes) + b"\n")
    message = (rf"train_file '{path}': 1 of 40 lines \(2\.5%\) are unreadable, above "
               r"max_bad_record_fraction=0\.01 \(line 21: not UTF-8 \(byte 0xe9 at column 28\)\)")  # fmt: skip
    with pytest.raises(DataError, match=message):
        load_raw_datasets(_args(train_file=str(path), source_lang="en", target_lang="de"), seed=0)
    raw = load_raw_datasets(_args(train_file=str(path), source_lang="en", target_lang="de",
                                  max_bad_record_fraction=0.05), seed=0)  # fmt: skip
    assert len(raw.train) == 39 and raw.skipped["train"]["unreadable_line"] == 1


def test_text_files_drop_a_non_utf8_line_in_every_language(tmp_path: Path, corpus: dict) -> None:
    for lang in ("en", "de"):
        data = "\n".join(corpus["train"][lang][:200]).encode() + b"\n"
        if lang == "de":
            data = data.replace(corpus["train"]["de"][7].encode(), b"gr\xfc\xdfe")  # latin-1 on line 8
        (tmp_path / f"t.{lang}").write_bytes(data)
    raw = load_raw_datasets(
        _args(train_file=str(tmp_path / "t.{lang}"), source_lang="en", target_lang="de"), 0
    )
    assert len(raw.train) == 199 and raw.skipped["train"]["unreadable_line"] == 1
    assert raw.train[7]["source"] == corpus["train"]["en"][8]  # alignment kept


def test_files_without_usable_records_name_the_file(tmp_path: Path) -> None:
    def fails(match: str, text: bytes, name: str = "t.jsonl", **kw: object) -> None:
        (tmp_path / name).write_bytes(text)
        with pytest.raises(DataError, match=match):
            args = {"train_file": str(tmp_path / name), "source_lang": "en", "target_lang": "de", **kw}
            load_raw_datasets(_args(**args), seed=0)

    # was: "is not valid json: StopIteration"
    fails(r"train_file '.*t\.jsonl' is empty: it holds no record", b"")
    fails(r"train_file '.*t\.jsonl' is empty", b"\n\n")
    fails(r"t\.jsonl' has no usable record: all 2 lines are unreadable \(line 1: a JSON list, not an object; "
          r"line 2: not valid JSON", b"[1]\n{\n", max_bad_record_fraction=1.0)  # fmt: skip
    (tmp_path / "t.en").write_text("a\n")
    fails(r"train_file '.*t\.de' is empty", b"", name="t.de", train_file=str(tmp_path / "t.{lang}"))
    fails(r"cannot read train_file '.*t\.jsonl\.gz': Not a gzipped file", b"{}\n", name="t.jsonl.gz")
    fails(r"\(train_file='.*v\.jsonl'\) is empty after filtering: no usable record for \['en-de'\]",
          b'{"translation": {"en": "a", "de": " "}}\n{"translation": {"en": "b"}}\n', name="v.jsonl")  # fmt: skip


# ---------------------------------------------------------------------------------------------- errors


def test_errors_name_the_bad_value(
    tmp_path: Path, text_dir: Path, corpus: dict, tok: SentencePieceTokenizer
) -> None:
    def fails(match: str, **kw: object) -> None:
        with pytest.raises(DataError, match=match):
            load_raw_datasets(_args(**{"source_lang": "en", "target_lang": "de", **kw}), seed=0)

    fails(r"train_file '/no/such\.jsonl' does not exist", train_file="/no/such.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"translation": {"en": "a", "de": "b"}}\n{not json\n')
    fails(rf"train_file '{bad}': 1 of 2 lines \(50\.0%\) are unreadable, above max_bad_record_fraction=0\.01 "
          r"\(line 2: not valid JSON", train_file=str(bad))  # fmt: skip
    fails(r"unknown format; use one of", train_file=str(tmp_path / "x.csv"))
    only_en_fr = _write_jsonl(tmp_path / "enfr.jsonl", _records(corpus, 5, ["en", "fr"]))
    fails(r"has no 'de' text; languages in the data: \['en', 'fr'\]", train_file=str(only_en_fr))
    fails(r"no file .*train\.ja\.gz.* for language 'ja'; files there: \[.*'train\.cs\.gz'",
          train_file=str(text_dir / "train.{lang}.gz"), source_lang="ja")  # fmt: skip
    short = tmp_path / "short"
    short.mkdir()
    (short / "t.en").write_text("a\nb\nc\n")
    (short / "t.de").write_text("a\nb\n")
    fails(r"not line-aligned, line counts differ: .*t\.de': 2.*t\.en': 3", train_file=str(short / "t.{lang}"))
    (short / "e.en").write_text(" \n\n")
    (short / "e.de").write_text("x\ny\n")
    fails(
        r"training corpus \(train_file='.*e\.\{lang\}'\) is empty after filtering",
        train_file=str(short / "e.{lang}"),
    )
    fails(r"dataset_name='/no/such/dir' is a path that does not exist", dataset_name="/no/such/dir")
    fails(r"no training data", train_file=None)
    (short / "long.en").write_text("a long sentence of many words\nanother long sentence here\n")
    args = _args(train_file=str(short / "long.{lang}"), source_lang="en", target_lang="en", max_source_length=3,
                 skip_long_examples=True)  # fmt: skip
    with pytest.raises(DataError, match=r"empty after filtering .*max_source_length=3"):
        tokenize_datasets(load_raw_datasets(args, 0), tok, args)
    with pytest.raises(ConfigError, match=r"max_source_length=2 must be >= 3"):
        _args(train_file=str(short / "long.{lang}"), source_lang="en", target_lang="de", max_source_length=2)


def test_batch_config_errors(data: TranslationData, tok: SentencePieceTokenizer) -> None:
    with pytest.raises(DataError, match="num_microbatches=0 must be >= 1"):
        BatchLayout(4, num_microbatches=0)
    with pytest.raises(DataError, match=r"fewer than one global batch"):
        GlobalBatchSampler(data.train, BatchLayout(10_000), 0, 1, 2)
    with pytest.raises(DataError, match=r"max_tokens_per_microbatch=5 is below the longest example"):
        GlobalBatchSampler(data.train, BatchLayout(1, max_tokens_per_microbatch=5), 0, 1, 2)
    lengths = np.maximum(column_array(data.train, "src_len"), column_array(data.train, "tgt_len"))
    longest = int(lengths.max())  # a cap that fits the longest example but not its bucket
    with pytest.raises(DataError, match=rf"padded to a multiple of pad_to_multiple_of={longest + 1}"):
        layout = BatchLayout(1, max_tokens_per_microbatch=longest, pad_to_multiple_of=longest + 1)
        GlobalBatchSampler(data.train, layout, 0, 1, 2)
    with pytest.raises(DataError, match="pad_to_multiple_of=0 must be >= 1"):
        BatchLayout(4, pad_to_multiple_of=0)


# ---------------------------------------------------------------------------------------------- batches

MESHES = [(1, 4, 2), (2, 2, 2), (4, 1, 2)]  # (dp, m, gas), K = 8


def _steps(data: TranslationData, dp: int, m: int, gas: int, n: int, max_tokens: int | None = None,
           pad: int = 1) -> list:  # fmt: skip
    layout = BatchLayout(4, m, gas, dp, max_tokens_per_microbatch=max_tokens, pad_to_multiple_of=pad)
    sampler = GlobalBatchSampler(data.train, layout, seed=3, pad_id=1, decoder_start_id=2)
    return [next(sampler) for _ in range(n)]


def _rows(batch: object) -> list[tuple[int, ...]]:
    ids = batch.input_ids.tolist()  # type: ignore[attr-defined]
    labels = batch.labels.tolist()  # type: ignore[attr-defined]
    return [tuple(x for x in s if x != 1) + (-1,) + tuple(y for y in t if y != IGNORE_INDEX)
            for s, t in zip(ids, labels)]  # fmt: skip


@pytest.mark.parametrize("max_tokens,pad", [(None, 1), (96, 1), (None, 8), (96, 8)])
def test_global_batches_do_not_depend_on_the_mesh(
    data: TranslationData, max_tokens: int | None, pad: int
) -> None:
    """Every mesh with the same global batch serves the same examples, also with lengths padded to
    buckets (`pad_to_multiple_of`): shapes are multiples of it, the token cap counts the padded
    lengths, and the padding share counts the positions the micro-batches really hold."""
    runs = {mesh: _steps(data, *mesh, n=6, max_tokens=max_tokens, pad=pad) for mesh in MESHES}
    for k in range(6):
        reference = runs[MESHES[0]][k]
        union_reference: Counter = Counter()
        for flush in reference.shard(0):
            for mb in flush:
                union_reference.update(_rows(mb))
        for (dp, m, gas), steps in runs.items():
            gb = steps[k]
            assert gb.example_indices() == reference.example_indices()
            assert gb.num_tokens == reference.num_tokens == sum(data.train[gb.example_indices()]["tgt_len"])
            union: Counter = Counter()
            positions = 0
            for rank in range(dp):
                share = gb.shard(rank)
                assert len(share) == gas and all(len(flush) == m for flush in share)  # same count everywhere
                for flush in share:
                    for mb in flush:
                        union.update(_rows(mb))
                        s_len, t_len = mb.input_ids.shape[1], mb.labels.shape[1]
                        assert s_len % pad == 0 and t_len % pad == 0
                        assert s_len - max(mb.src_lengths) < pad and t_len - max(mb.tgt_lengths) < pad
                        positions += mb.size * (s_len + t_len)
                        if max_tokens:
                            assert mb.size * max(mb.input_ids.shape[1], mb.labels.shape[1]) <= max_tokens
                        else:
                            assert mb.size == 4
            assert union == union_reference
            assert positions == gb.padded_tokens


def test_microbatches_are_length_sorted_and_trimmed(data: TranslationData) -> None:
    gb = _steps(data, 1, 4, 2, n=1)[0]
    mbs = [mb for flush in gb.shard(0) for mb in flush]
    for mb in mbs:
        assert int(mb.attention_mask.sum(1).max()) == mb.input_ids.shape[1]  # no global padding
    widths = [mb.input_ids.shape[1] for mb in mbs]
    assert max(widths) - min(widths) <= max(widths) // 2 + 2  # bucketed: similar lengths in a batch


def test_epochs_cover_data_and_differ(data: TranslationData) -> None:
    sampler = GlobalBatchSampler(data.train, BatchLayout(8, 2, 2, 2), 0, 1, 2)
    first, second = sampler.epoch_plan(0), sampler.epoch_plan(1)
    seen = np.concatenate([s for b in first for s in b])
    assert len(seen) == len(set(seen.tolist())) == len(first) * 64 > len(data.train) - 64
    assert [b[0].tolist() for b in first] != [b[0].tolist() for b in second]


def test_resume_neither_skips_nor_repeats(data: TranslationData) -> None:
    layout = BatchLayout(32, 2, 2, 2)  # 256 pairs: an epoch of 17 steps, so the run crosses epochs
    straight = GlobalBatchSampler(data.train, layout, 7, 1, 2)
    expected = [next(straight).example_indices() for _ in range(25)]
    first = GlobalBatchSampler(data.train, layout, 7, 1, 2)
    for _ in range(15):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = GlobalBatchSampler(data.train, layout, 7, 1, 2)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(10)]
    assert [b.example_indices() for b in got] == expected[15:]
    assert got[0].step == 15 and got[-1].epoch == 1
    other_mesh = GlobalBatchSampler(data.train, BatchLayout(32, 4, 2, 1), 7, 1, 2)
    other_mesh.load_state_dict(state)  # same global batch size: a checkpoint loads on another mesh
    assert next(other_mesh).example_indices() == expected[15]
    with pytest.raises(DataError, match="data state from a different run"):
        GlobalBatchSampler(data.train, BatchLayout(16, 2, 2, 2), 7, 1, 2).load_state_dict(state)


def test_eval_batches_keep_references(
    data: TranslationData, tok: SentencePieceTokenizer, corpus: dict
) -> None:
    batches = eval_batches(data, tok, batch_size=32)
    en_de = batches["en-de"]
    assert sum(b.batch.size for b in en_de) == 200
    refs = {r for b in en_de for r in b.references}
    assert refs == set(corpus["val"]["de"])
    b = en_de[0]
    assert b.forced_bos_token_id == tok.lang_id("de")
    assert [tok.decode(row.tolist()) for row in b.batch.labels] == b.references
    assert [tok.decode(row.tolist()) for row in b.batch.input_ids] == b.sources


def test_training_texts_are_distinct(data: TranslationData, text_dir: Path) -> None:
    args = _args(train_file=str(text_dir / "train.{lang}.gz"), language_pairs=["en-de", "de-en"])
    texts = list(training_texts(load_raw_datasets(args, 0).train))
    assert len(texts) == len(set(texts)) <= 2 * N


def test_setup_logs_only_the_nonzero_skip_counts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 36: every run logged `data skipped: {...}` with every counter of every split and direction,
    ~1,000 characters of zeros; now only the counts that are not 0, and nothing when all are."""
    import logging

    from models.config import ModelConfig
    from parallel.mesh import ParallelDims
    from trainer.config.parse import load_config_dict
    from trainer.run.setup import record_setup

    zeros = {"unreadable_line": 0, "missing_side": 0, "empty_text": 0, "truncated_source": 0}
    skipped = {
        "train": {**zeros, "missing_side": 3},
        **{f"validation:{d}": dict(zeros) for d in ("en-de", "de-en")},
    }
    mc = ModelConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)  # fmt: skip
    cfg, dims = load_config_dict({"output_dir": str(tmp_path)}), ParallelDims(1, 1, 1, 1)
    with caplog.at_level(logging.INFO, logger="trainer"):
        record_setup(cfg, tmp_path, dims, mc, "one stage", skipped)
        record_setup(cfg, tmp_path, dims, mc, "one stage", {k: dict(zeros) for k in skipped})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model: ")]
    size = f"{mc.num_parameters() / 1e6:.2f}M"
    assert lines == [
        f"model: {size} parameters; data skipped: {{'train': {{'missing_side': 3}}}}",
        f"model: {size} parameters",
    ]


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "nllb-moe-dropless"])
def test_padding_to_buckets_leaves_the_loss_unchanged(data: TranslationData, tok: SentencePieceTokenizer,
                                                      experts: int) -> None:  # fmt: skip
    """`pad_to_multiple_of` adds positions that are masked keys and ignored labels: the loss and
    every gradient equal the unpadded batch's (fp32), also where the model passes the key mask
    when nothing is padded (`always_mask`, as a compiled model does). Capacity-limited expert
    routing counts positions (as transformers' NllbMoe does), so the MoE case routes dropless."""
    import torch

    from models.config import ModelConfig
    from models.m2m100 import M2M100Translation
    from trainer.data.batching import collate

    rows = data.train[list(range(8))]
    special = tok.special_ids()
    moe = {"num_experts": experts, "encoder_sparse_step": 2, "decoder_sparse_step": 2} if experts else {}
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                      decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                      moe_token_dropout=0.0, **moe)  # fmt: skip
    model = M2M100Translation(cfg, seed=0)
    model.moe.dropless = True

    def loss_and_grads(pad: int, always_mask: bool) -> tuple[float, list[torch.Tensor]]:
        batch = collate(rows["input_ids"], rows["labels"], tok.pad_id, special["decoder_start_token_id"], pad)
        assert batch.input_ids.shape[1] % pad == 0 and batch.labels.shape[1] % pad == 0
        model.zero_grad(set_to_none=True)
        model.always_mask = always_mask
        loss, n = model.loss(batch)
        (loss / n).backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref, ref_grads = loss_and_grads(1, False)
    for pad, always in ((8, False), (16, True), (1, True)):
        got, grads = loss_and_grads(pad, always)
        assert abs(got - ref) <= 1e-6 * abs(ref), (pad, always, got, ref)
        assert len(grads) == len(ref_grads)
        for g, r in zip(grads, ref_grads):
            assert torch.allclose(g, r, rtol=1e-5, atol=1e-7), (pad, always)
