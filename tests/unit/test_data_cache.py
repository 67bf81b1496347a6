"""Tokenization cached on disk (memory-mapped Arrow, keyed by data + tokenizer + lengths) and
tokenized by `preprocessing_num_workers` processes, on multi30k-layout text (`multi30k`)."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest

import trainer.data.tokenization as data_module
from tests.corpus_data import read_lines
from trainer.config.data_args import DataArguments
from trainer.data.sources import load_raw_datasets
from trainer.data.tokenization import TranslationData, tokenize_datasets
from trainer.tokenizer.vocab import SentencePieceTokenizer, train_tokenizer

N = 1200


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory, multi30k: Path) -> Path:
    d = tmp_path_factory.mktemp("text")
    for lang in ("de", "en"):
        lines = read_lines(multi30k, "train", lang, N)
        for split, part in (("train", lines[:1000]), ("val", lines[1000:])):
            with gzip.open(d / f"{split}.{lang}.gz", "wt", encoding="utf-8") as g:
                g.write("\n".join(part) + "\n")
    return d


@pytest.fixture(scope="module")
def tok(text_dir: Path) -> SentencePieceTokenizer:
    with gzip.open(text_dir / "train.en.gz", "rt") as f, gzip.open(text_dir / "train.de.gz", "rt") as g:
        return train_tokenizer([*f.read().splitlines(), *g.read().splitlines()], ["de", "en"], 600, seed=0)


def _args(text_dir: Path, **kw: Any) -> DataArguments:
    return DataArguments(train_file=str(text_dir / "train.{lang}.gz"), validation_file=str(text_dir / "val.{lang}.gz"),
                         language_pairs=["en-de", "de-en"],
                         **{"max_source_length": 24, "skip_long_examples": True, **kw})  # fmt: skip


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the batches this process tokenizes (a cache hit tokenizes none)."""
    count = [0]
    real = data_module._tokenize_batch

    def counting(*a: Any, **kw: Any) -> dict[str, list[Any]]:
        count[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(data_module, "_tokenize_batch", counting)
    return count


def _rows(data: TranslationData) -> tuple[Any, ...]:
    return data.train[:], {k: v[:] for k, v in data.validation.items()}, data.skipped


def test_second_run_loads_the_cache(text_dir: Path, tok: SentencePieceTokenizer, tmp_path: Path,
                                    calls: list[int]) -> None:  # fmt: skip
    args = _args(text_dir)
    first = tokenize_datasets(load_raw_datasets(args, 0), tok, args, tmp_path)
    assert calls[0] > 0 and first.skipped["train"]["source_too_long"] > 0
    assert len(list(tmp_path.glob("tokenized-*.arrow"))) == 3  # train + 2 validation directions
    files = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}  # and the filters' index files
    # the examples live in the cache's Arrow files (memory-mapped), not in this process's heap
    assert {Path(f["filename"]).parent for f in first.train.cache_files} == {tmp_path}

    tokenized = calls[0]
    again = tokenize_datasets(load_raw_datasets(args, 0), tok, args, tmp_path)  # data read anew: a restart
    assert calls[0] == tokenized  # nothing tokenized again
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == files
    assert _rows(again) == _rows(first)  # skip counts included

    longer = _args(text_dir, max_source_length=40)  # another key: tokenized again, in a new file
    tokenize_datasets(load_raw_datasets(longer, 0), tok, longer, tmp_path)
    assert calls[0] > tokenized and len(list(tmp_path.glob("tokenized-*.arrow"))) == 6


def test_workers_give_the_same_examples(text_dir: Path, tok: SentencePieceTokenizer, tmp_path: Path,
                                        calls: list[int]) -> None:  # fmt: skip
    one = _args(text_dir)
    single = tokenize_datasets(load_raw_datasets(one, 0), tok, one)  # no cache of ours
    two = _args(text_dir, preprocessing_num_workers=2)
    parallel = tokenize_datasets(load_raw_datasets(two, 0), tok, two, tmp_path)
    assert _rows(parallel) == _rows(single)
    assert len(list(tmp_path.glob("tokenized-*_of_00002.arrow"))) == 6  # 3 splits x 2 worker shards
    # the worker count may change on resume: a one-process run loads the two workers' shards
    tokenized = calls[0]
    assert _rows(tokenize_datasets(load_raw_datasets(one, 0), tok, one, tmp_path)) == _rows(single)
    assert calls[0] == tokenized


def test_text_files_read_anew_when_they_change(tmp_path: Path) -> None:
    """Text files stream into `datasets`' cache keyed by path, size and mtime: an edited file is
    read again, never served from the cache of its earlier content."""
    for lang, text in (("de", "ein Hund\nzwei Katzen\n"), ("en", "a dog\ntwo cats\n")):
        (tmp_path / f"t.{lang}").write_text(text)
    args = DataArguments(train_file=str(tmp_path / "t.{lang}"), language_pairs=["en-de"])
    assert load_raw_datasets(args, 0).train[:]["target"] == ["ein Hund", "zwei Katzen"]
    (tmp_path / "t.de").write_text("ein Hund\ndrei Katzen\n")
    assert load_raw_datasets(args, 0).train[:]["target"] == ["ein Hund", "drei Katzen"]


def _served_rows(gb: Any, dp: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (input_ids, labels) of every example a global batch hands its dp replicas, sorted."""
    rows = []
    for rank in range(dp):
        for flush in gb.shard(rank):
            for mb in flush:
                for ids, mask, labels in zip(
                    mb.input_ids.tolist(), mb.attention_mask.tolist(), mb.labels.tolist()
                ):
                    rows.append(
                        (tuple(i for i, m in zip(ids, mask) if m), tuple(t for t in labels if t >= 0))
                    )
    return sorted(rows)


def test_memory_mapped_data_resumes_exactly_on_another_mesh(text_dir: Path, tok: SentencePieceTokenizer,
                                                            tmp_path: Path) -> None:  # fmt: skip
    """A corpus larger than memory: examples are memory-mapped from the cache's Arrow files (with
    the length filter's indices mapping over them) and fetched per batch. A run on dp=2 saves its
    data position mid-epoch; a restart (data loaded anew from the cache) on dp=2, dp=1 and with
    more micro-batches serves the same rows at every following step, across the epoch boundary."""
    import json

    from trainer.data.batching import BatchLayout, GlobalBatchSampler

    args = _args(text_dir)

    def sampler(layout: BatchLayout) -> GlobalBatchSampler:
        data = tokenize_datasets(load_raw_datasets(args, 0), tok, args, tmp_path)  # a process's load
        assert {Path(f["filename"]).parent for f in data.train.cache_files} == {tmp_path}
        return GlobalBatchSampler(data.train, layout, 3, tok.pad_id, tok.eos_id)

    straight = sampler(BatchLayout(8, 2, 1, 2))  # global batch 32
    assert straight.train._indices is not None  # filtered rows: an indices mapping over the Arrow file
    epoch = len(straight.epoch_plan(0))
    for _ in range(epoch - 5):
        next(straight)
    state = json.loads(json.dumps(straight.state_dict()))  # as trainer_state.json holds it
    expected = [_served_rows(next(straight), 2) for _ in range(10)]
    assert straight.epoch == 1  # the 10 steps cross into the next epoch
    for layout in (BatchLayout(8, 2, 1, 2), BatchLayout(16, 2, 1, 1), BatchLayout(4, 4, 2, 1)):
        resumed = sampler(layout)
        resumed.load_state_dict(state)
        got = [_served_rows(next(resumed), layout.dp_size) for _ in range(10)]
        assert got == expected, layout
