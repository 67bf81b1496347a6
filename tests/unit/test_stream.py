"""Streaming data (`streaming: true`): shards, pieces, the chunk stream and its global batches.

The contracts, on small sharded corpora whose every text is unique (so an example is known by its
text): an epoch serves every pair exactly once (only the last partial global batch is dropped, and
counted); the batches do not depend on the number of worker processes, the dp size or a resume
(anywhere in a window, on another dp size); temperature sampling follows its shares; many
directions keep the open files bounded; bad lines are skipped and named by shard and line.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer.config.data_args import DataArguments
from trainer.data import stream as stream_module
from trainer.data.batching import BatchLayout
from trainer.data.shards import PieceReader, resolve_shards, split_pieces
from trainer.data.streaming import build_stream_sampler, open_corpus, sample_texts, stream_spec
from trainer.errors import ConfigError, DataError
from trainer.tokenizer.vocab import SentencePieceTokenizer, train_tokenizer

LANGS = ["en", "de", "fr"]


def _text(lang: str, shard: int, i: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    return f"{lang} {shard} {i} " + " ".join(words[: 1 + (i * 7 + shard) % 6])


def _write(path: Path, records: list[dict[str, Any]], flat: bool = False) -> Path:
    lines = "".join(json.dumps(r if flat else {"translation": r}) + "\n" for r in records)
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(lines)
    else:
        path.write_text(lines)
    return path


def _corpus(root: Path, sizes: dict[str, int], multiway: int = 0) -> Path:
    """One shard per direction `src-tgt` with `sizes[d]` records (the first gzipped), and `multiway`
    records holding every language (a shard that serves every direction)."""
    root.mkdir(parents=True, exist_ok=True)
    for k, (name, n) in enumerate(sizes.items()):
        s, t = name.split("-")
        suffix = ".jsonl.gz" if k == 0 else ".jsonl"
        _write(root / f"train-{name}{suffix}", [{s: _text(s, k, i), t: _text(t, k, i)} for i in range(n)])
    if multiway:
        _write(
            root / "train-all.jsonl", [{lang: _text(lang, 99, i) for lang in LANGS} for i in range(multiway)]
        )
    return root


@pytest.fixture(scope="module")
def tok() -> SentencePieceTokenizer:
    texts = [_text(lang, s, i) for lang in LANGS for s in range(3) for i in range(50)]
    return train_tokenizer(texts, LANGS, 200, "bpe")


def _args(root: Path, pairs: list[str], **kw: Any) -> DataArguments:
    return DataArguments(train_file=str(root / "train-*"), streaming=True, language_pairs=pairs,
                         max_source_length=32, max_target_length=32, **kw)  # fmt: skip


def _sampler(args: DataArguments, tok: SentencePieceTokenizer, layout: BatchLayout, workers: int = 0):
    spec, expected = stream_spec(open_corpus(args), args, seed=3)
    return build_stream_sampler(spec, expected, args, layout, tok, log_notes=False, workers=workers)


def _examples(gb: Any, dp: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The global batch's examples, (source ids, target ids), over every replica's micro-batches."""
    out = []
    for r in range(dp):
        for flush in gb.shard(r):
            for mb in flush:
                for src, tgt, n, m in zip(
                    mb.input_ids.tolist(), mb.labels.tolist(), mb.src_lengths, mb.tgt_lengths
                ):
                    out.append((tuple(src[:n]), tuple(tgt[:m])))
    return out


def _served(sampler: Any, steps: int, dp: int = 1) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Per step, the sorted examples of the global batch."""
    return [sorted(_examples(next(sampler), dp)) for _ in range(steps)]


# ---------------------------------------------------------------------------------------------- shards


def test_pieces_cover_every_line_once(tmp_path: Path) -> None:
    """A plain shard cut at byte offsets: each line belongs to the piece where it starts, so the
    pieces together read every line once, in order; a reader resumes at its saved position."""
    records = [{"en": f"line {i} " + "x" * (i % 37), "de": f"zeile {i}"} for i in range(500)]
    path = _write(tmp_path / "a.jsonl", records)
    [shard] = resolve_shards(str(path), ["en", "de"])
    pieces = split_pieces([shard], piece_bytes=997)
    assert len(pieces) > 20 and pieces[0].start == 0 and pieces[-1].end == shard.size
    got = [r["en"] for p in pieces for r in PieceReader(shard, p, 0.01)]
    assert got == [r["en"] for r in records]
    reader = PieceReader(shard, pieces[3], 0.01)
    it = iter(reader)
    first = [next(it)["en"] for _ in range(2)]
    rest = [r["en"] for r in PieceReader(shard, pieces[3], 0.01, reader.position())]
    assert first + rest == [r["en"] for r in PieceReader(shard, pieces[3], 0.01)]
    assert 450 < shard.records < 550  # estimated from the first 64 lines and the size


def test_text_gzip_and_parquet_shards(tmp_path: Path) -> None:
    """`{lang}` patterns with a wildcard, gzip shards resumed by line count, Parquet row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k in range(2):
        (tmp_path / f"part{k}.en").write_text("".join(f"e{k}-{i}\n" for i in range(5)))
        (tmp_path / f"part{k}.de").write_text("".join(f"d{k}-{i}\n" for i in range(5)))
    shards = resolve_shards(str(tmp_path / "part*.{lang}"), ["en", "de", "fr"])
    assert [s.path for s in shards] == [str(tmp_path / "part0.{lang}"), str(tmp_path / "part1.{lang}")]
    assert [r["de"] for r in PieceReader(shards[1], split_pieces(shards)[1], 0.01)] == [
        f"d1-{i}" for i in range(5)
    ]
    gz = _write(tmp_path / "g.jsonl.gz", [{"en": f"g{i}", "de": f"h{i}"} for i in range(9)])
    [shard] = resolve_shards(str(gz), ["en", "de"])
    assert [r["en"] for r in PieceReader(shard, split_pieces([shard])[0], 0.01, 4)] == [
        f"g{i}" for i in range(4, 9)
    ]
    table = pa.table({"translation": [{"en": f"p{i}", "de": f"q{i}"} for i in range(10)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=4)
    [shard] = resolve_shards(str(tmp_path / "t.parquet"), ["en", "de"])
    assert shard.languages == ("de", "en") and shard.records == 10
    pieces = split_pieces([shard])
    assert len(pieces) == 3
    assert [r["en"] for p in pieces for r in PieceReader(shard, p, 0.01)] == [f"p{i}" for i in range(10)]
    (tmp_path / "bad.en").write_text("a\nb\n")
    (tmp_path / "bad.de").write_text("a\n")
    [bad] = resolve_shards(str(tmp_path / "bad.{lang}"), ["en", "de"])
    with pytest.raises(DataError, match=r"not line-aligned"):
        list(PieceReader(bad, split_pieces([bad])[0], 0.01))


def test_missing_and_empty_shards_fail_before_step_1(tmp_path: Path) -> None:
    root = _corpus(tmp_path / "c", {"en-de": 10})
    with pytest.raises(DataError, match=r"train_file '.*nothing-\*\.jsonl' matches no file"):
        resolve_shards(str(tmp_path / "nothing-*.jsonl"), ["en", "de"])
    with pytest.raises(DataError, match=r"shard '.*gone\.jsonl' does not exist"):
        resolve_shards([str(root / "train-*"), str(tmp_path / "gone.jsonl")], ["en", "de"])
    (root / "train-empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"shard '.*train-empty\.jsonl' is empty \(0 bytes\)"):
        open_corpus(_args(root, ["en-de"]))
    (root / "train-empty.jsonl").unlink()
    with pytest.raises(DataError, match=r"no shard holds both 'en' and 'fr' \(direction en-fr\)"):
        open_corpus(_args(root, ["en-de", "en-fr"]))
    (root / "train-array.json").write_text('[{"en": "a", "de": "b"}]\n')
    with pytest.raises(DataError, match=r"is a JSON array; streaming reads JSON lines"):
        open_corpus(_args(root, ["en-de"]))


# ---------------------------------------------------------------------------------------------- epochs


def test_an_epoch_serves_every_pair_once(tmp_path: Path, tok: SentencePieceTokenizer) -> None:
    """Sampling off: over one epoch each (record, direction) pair is served exactly once, from
    gzip, plain and multi-way shards; the last partial global batch is dropped and counted."""
    root = _corpus(tmp_path / "c", {"en-de": 300, "de-en": 70, "fr-en": 130}, multiway=40)
    args = _args(root, ["en-de", "de-en", "fr-en", "en-fr"])
    layout = BatchLayout(4, 2, 1, 2)  # G = 16
    sampler = _sampler(args, tok, layout)
    total = 2 * (300 + 70 + 130) + 4 * 40  # a record {en, de} is a pair of en-de and of de-en
    seen: Counter[tuple[tuple[int, ...], tuple[int, ...]]] = Counter()
    while True:
        gb = next(sampler)
        if gb.epoch > 0:
            break
        seen.update(_examples(gb, 2))
    assert max(seen.values()) == 1
    assert sum(seen.values()) == total // 16 * 16
    # the epoch is one window (W = 1632 > 1160): epoch 0's and epoch 1's each dropped their tail
    assert sampler.skipped["dropped_tail"] == 2 * (total % 16)
    shares = sampler.shares()  # they count every example served, epoch 1's first batch included
    assert sum(v["examples"] for v in shares.values()) == total // 16 * 16 + 16


def test_batches_are_the_same_for_any_worker_count_and_dp(
    tmp_path: Path, tok: SentencePieceTokenizer
) -> None:
    """The global batch sequence depends on the data and the seed only: in-process reading, two
    worker processes, dp=1 or dp=2 with the same global batch give the same examples per step
    (lengths padded to multiples of 8: `pad_to_multiple_of`)."""
    root = _corpus(tmp_path / "c", {"en-de": 400, "de-en": 300, "fr-en": 200}, multiway=30)
    args = _args(root, ["en-de", "de-en", "fr-en"])
    steps = 40
    one = _served(_sampler(args, tok, BatchLayout(8, 2, 1, 1, pad_to_multiple_of=8)), steps)
    workers = _sampler(args, tok, BatchLayout(4, 2, 1, 2, pad_to_multiple_of=8), workers=2)
    try:
        assert _served(workers, steps, dp=2) == one
    finally:
        workers.close()


def test_resume_anywhere_continues_exactly(tmp_path: Path, tok: SentencePieceTokenizer) -> None:
    """A state saved mid-window (and across an epoch boundary) restores the exact sequence, also
    with workers and on another dp size; another corpus or global batch is refused."""
    root = _corpus(tmp_path / "c", {"en-de": 250, "de-en": 120}, multiway=20)
    args = _args(root, ["en-de", "de-en"])
    straight = _sampler(args, tok, BatchLayout(4, 1, 1, 2))
    reference = _served(straight, 70, dp=2)
    for cut in (3, 29, 47):
        first = _sampler(args, tok, BatchLayout(4, 1, 1, 2))
        _served(first, cut, dp=2)
        state = json.loads(json.dumps(first.state_dict()))  # as trainer_state.json holds it
        resumed = _sampler(args, tok, BatchLayout(8, 1, 1, 1), workers=1)
        try:
            resumed.load_state_dict(state)
            assert _served(resumed, 70 - cut) == reference[cut:], cut
            assert resumed.skipped == straight.skipped  # counts restored, then the same chunks counted
        finally:
            resumed.close()
    other = _sampler(args, tok, BatchLayout(4, 1, 1, 1))
    with pytest.raises(DataError, match=r"data state from a different run"):
        other.load_state_dict(state)


def test_temperature_sampling_follows_its_shares(tmp_path: Path, tok: SentencePieceTokenizer) -> None:
    """T=5 upsamples the small direction (its lanes start over, re-permuted) to p_d."""
    root = _corpus(tmp_path / "c", {"en-de": 2000, "fr-en": 100})
    args = _args(root, ["en-de", "fr-en"], sampling_temperature=5.0)
    sampler = _sampler(args, tok, BatchLayout(8, 1, 1, 2))
    _served(sampler, 150, dp=2)
    shares = sampler.shares()
    p = shares["fr-en"]["expected"]
    assert 0.33 < p < 0.38  # (100/2000)^(1/5) / (1 + (100/2000)^(1/5)) = 0.354, from estimated sizes
    assert abs(shares["fr-en"]["realised"] - p) < 0.03
    assert shares["fr-en"]["examples"] > 300  # three times what the direction holds: upsampled


def test_many_directions_keep_open_files_bounded(
    tmp_path: Path, tok: SentencePieceTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """210 directions, one lane each: readers are opened lazily and at most MAX_OPEN_READERS stay
    open (least recently used closed, re-opened at their position); the batches do not change."""
    langs = [f"l{i:02d}" for i in range(15)]
    root = tmp_path / "many"
    root.mkdir()
    pairs = [f"{a}-{b}" for a in langs for b in langs if a != b]
    for k, name in enumerate(pairs):
        s, t = name.split("-")
        suffix = ".jsonl.gz" if k % 2 else ".jsonl"
        _write(
            root / f"train-{name}{suffix}", [{s: _text("en", k, i), t: _text("de", k, i)} for i in range(40)]
        )
    big = train_tokenizer(
        [_text(x, s, i) for x in ("en", "de") for s in range(5) for i in range(30)], langs, 300
    )
    args = _args(root, pairs, sampling_temperature=5.0)
    reference = _served(_sampler(args, big, BatchLayout(16, 1, 1, 1)), 30)
    monkeypatch.setattr(stream_module, "MAX_OPEN_READERS", 8)
    fds = len(os.listdir("/proc/self/fd"))
    sampler = _sampler(args, big, BatchLayout(16, 1, 1, 1))
    assert _served(sampler, 30) == reference
    assert len(os.listdir("/proc/self/fd")) <= fds + 8
    assert len([n for n, v in sampler.shares().items() if v["examples"]]) > 60


def test_bad_lines_are_named_by_shard_and_line(tmp_path: Path, tok: SentencePieceTokenizer,
                                               caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    root = _corpus(tmp_path / "c", {"en-de": 200, "de-en": 200})
    path = root / "train-de-en.jsonl"
    lines = path.read_text().splitlines()
    lines[116] = '{"translation": {"de": "kaputt'
    path.write_text("\n".join(lines) + "\n")
    args = _args(root, ["en-de", "de-en"])
    sampler = _sampler(args, tok, BatchLayout(8, 1, 1, 1))
    sampler.log_notes = True
    with caplog.at_level("WARNING"):
        _served(sampler, 40)  # within the first epoch (399 pairs)
    assert sampler.skipped["unreadable_line"] == 1
    assert f"shard '{path}': skipped 1 unreadable line(s) of 200 (line 117: not valid JSON" in caplog.text
    lines[10:20] = ["{broken"] * 10  # 11 of 200: above max_bad_record_fraction=0.01
    path.write_text("\n".join(lines) + "\n")
    sampler = _sampler(args, tok, BatchLayout(8, 1, 1, 1), workers=1)
    try:
        with pytest.raises(
            DataError,
            match=rf"shard '{path}': 11 of 200 lines .* above max_bad_record_fraction=0.01 \(line 11: not valid JSON",
        ):
            _served(sampler, 60)
    finally:
        sampler.close()


def test_token_capped_windows(tmp_path: Path, tok: SentencePieceTokenizer) -> None:
    """Token-capped slots within a window: each under the cap, K per global batch, the padding
    share measured; the window's last global batch is completed by halving slots."""
    root = _corpus(tmp_path / "c", {"en-de": 500, "de-en": 200})
    args = _args(root, ["en-de", "de-en"], max_tokens_per_microbatch=96)
    sampler = _sampler(args, tok, BatchLayout(1, 2, 1, 2, 96))
    for _ in range(30):
        gb = next(sampler)
        assert len(gb.slots) == 4
        for s in gb.slots:
            assert len(s) * int(np.maximum(gb.src_len[s], gb.tgt_len[s]).max()) <= 96
        assert 0.0 <= gb.padding_fraction < 0.5
        src, tgt = gb.example_lengths()  # what MFU counts FLOPs from
        assert len(src) == len(tgt) == sum(len(s) for s in gb.slots) and int(tgt.sum()) == gb.num_tokens
    # lengths padded to multiples of 8 (`pad_to_multiple_of`): the cap counts the padded lengths,
    # and the padding share the positions the micro-batches hold
    sampler = _sampler(args, tok, BatchLayout(1, 2, 1, 2, 96, pad_to_multiple_of=8))
    for _ in range(10):
        gb = next(sampler)
        positions = 0
        for rank in range(2):
            for mb in (mb for flush in gb.shard(rank) for mb in flush):
                s_len, t_len = mb.input_ids.shape[1], mb.labels.shape[1]
                assert s_len % 8 == 0 and t_len % 8 == 0 and mb.size * max(s_len, t_len) <= 96
                positions += mb.size * (s_len + t_len)
        assert positions == gb.padded_tokens
        assert gb.padding_fraction == 1 - (gb.num_tokens + gb.num_src_tokens) / positions


def test_tokenizer_sample_is_bounded_and_seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample reads about `sentences` texts at random offsets, whatever the corpus size."""
    root = _corpus(tmp_path / "c", {"en-de": 5000, "fr-en": 1000})
    args = _args(root, ["en-de", "fr-en"])
    spec, expected = stream_spec(open_corpus(args), args, seed=0)
    read = [0]
    real = PieceReader.__iter__

    def counting(self: PieceReader):  # type: ignore[no-untyped-def]
        for record in real(self):
            read[0] += 1
            yield record

    monkeypatch.setattr(PieceReader, "__iter__", counting)
    texts = sample_texts(spec, expected, 400, seed=1)
    assert 380 <= len(texts) <= 440 and read[0] < 1000
    assert texts == sample_texts(spec, expected, 400, seed=1)
    assert texts != sample_texts(spec, expected, 400, seed=2)
    en_de = sum(1 for t in texts if t.startswith("en 0 "))
    assert 150 < en_de < 185  # its share, 5000 / 6000 of 200 pairs


def test_streaming_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"streaming: true reads data files; dataset_name='builtin'"):
        DataArguments(dataset_name="builtin", streaming=True, source_lang="en", target_lang="de")
    with pytest.raises(ConfigError, match=r"max_train_samples=10 truncates an in-memory dataset"):
        DataArguments(
            train_file="x-*.jsonl", streaming=True, max_train_samples=10, source_lang="en", target_lang="de"
        )
    from trainer.config.parse import load_config_dict
    from trainer.run.preflight import check_streaming

    base = {"train_file": "x-*.jsonl", "streaming": True, "source_lang": "en", "target_lang": "de"}
    with pytest.raises(ConfigError, match=r"streaming: true needs max_steps > 0 \(got -1"):
        check_streaming(load_config_dict(base))
    with pytest.raises(ConfigError, match=r"eval_strategy='epoch' needs the epoch's length"):
        check_streaming(load_config_dict({**base, "max_steps": 5, "eval_strategy": "epoch"}))
    cfg = load_config_dict({**base, "train_file": ["a-*.jsonl", "b.parquet"], "max_steps": 5})
    assert cfg.data.train_files() == ["a-*.jsonl", "b.parquet"]


def test_dataset_directory_streams_its_train_files(tmp_path: Path, tok: SentencePieceTokenizer) -> None:
    """`dataset_name` naming a local directory of data files, with `streaming: true`: its `train`
    files are the shards (never loaded into Arrow), its validation file is read as evaluation data."""
    from trainer.data.sources import load_raw_datasets

    root = tmp_path / "ds"
    root.mkdir()
    for k in range(3):
        _write(
            root / f"train-0000{k}-of-00003.jsonl",
            [{"en": _text("en", k, i), "de": _text("de", k, i)} for i in range(60)],
        )
    _write(root / "validation.jsonl", [{"en": f"v {i}", "de": f"w {i}"} for i in range(7)])
    args = DataArguments(dataset_name=str(root), streaming=True, source_lang="en", target_lang="de")
    corpus = open_corpus(args)
    assert [Path(s.path).name for s in corpus.shards] == [f"train-0000{k}-of-00003.jsonl" for k in range(3)]
    raw = load_raw_datasets(args, seed=0)
    assert raw.train is None and len(raw.validation["en-de"]) == 7
    sampler = _sampler(args, tok, BatchLayout(6, 1, 1, 1))
    assert sum(len(s) for s in next(sampler).slots) == 6


def test_workers_die_with_their_training_process(tmp_path: Path) -> None:
    """A rank killed with SIGKILL (torchrun's restart, the OOM killer) leaves no data worker behind;
    the signals that stop a run do not stop its workers (issue 36: Ctrl-C reaches the whole process
    group, SLURM every process of a step, and a worker ended by one failed the rank's save with
    "data worker died"): the rank decides, and its workers serve until it tells them to exit."""
    import signal
    import subprocess
    import sys
    import time

    root = _corpus(tmp_path / "c", {"en-de": 3000, "fr-en": 3000})
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from test_stream import _args, _sampler, _text, LANGS
from trainer.data.batching import BatchLayout
from trainer.tokenizer.vocab import train_tokenizer
tok = train_tokenizer([_text(x, s, i) for x in LANGS for s in range(3) for i in range(50)], LANGS, 200, "bpe")
sampler = _sampler(_args(Path({str(root)!r}), ["en-de", "fr-en"]), tok, BatchLayout(4, 1, 1, 1), workers=2)
next(sampler)
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
    for p in sampler.source.procs:
        os.kill(p.pid, s)
import time
time.sleep(1)
alive = all(p.is_alive() for p in sampler.source.procs)
print(" ".join(str(p.pid) for p in sampler.source.procs), alive, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    *words, alive = done.stdout.split()
    assert alive == "True", done.stderr[-2000:]  # the stop signals left them running
    pids = [int(p) for p in words]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.2)
    assert not alive, f"orphaned data workers {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())
