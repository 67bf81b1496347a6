"""Sequence-level distillation data (`python -m trainer.distill_data`, `trainer.eval.seqkd`).

A teacher decodes a sharded JSON-lines corpus into shards of the same names: each record
{src: source, tgt: the teacher's translation}, equal to one-process decoding of the sources.
A run killed after its first shard (a half-written temporary file of the second left behind)
is rerun: the finished shard is not touched, the second is written whole; a third run does
nothing. Bad input is one line, exit 2, before any weight is read.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from models.generate import SearchSettings
from tests.unit.test_distill_config import _texts
from trainer.distill_data import main

LANGS = ["de", "en"]
pytestmark = pytest.mark.slow  # decodes a corpus three times (a one-rank process group each)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny teacher (random weights, an HF directory) and two shards, one gzipped."""
    from models.config import ModelConfig
    from models.hf_save import save_hf_model
    from models.m2m100 import M2M100Translation
    from trainer.tokenizer.vocab import train_tokenizer

    root = tmp_path_factory.mktemp("seqkd")
    texts = _texts(0)
    tok = train_tokenizer(texts, LANGS, 100, seed=0)
    mc = ModelConfig(vocab_size=tok.vocab_size, d_model=16, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                     decoder_ffn_dim=32, init_std=0.3, **tok.special_ids())  # fmt: skip
    teacher = root / "teacher"
    save_hf_model(M2M100Translation(mc, seed=3).state_dict(), mc, teacher)
    tok.save_pretrained(teacher)
    shards = root / "shards"
    shards.mkdir()
    lines = [
        json.dumps({"translation": {"en": texts[i], "de": texts[i + 1]}}) + "\n" for i in range(0, 24, 2)
    ]
    (shards / "train-a.jsonl").write_text("".join(lines[:7]) + "not json\n" + "\n")
    with gzip.open(shards / "train-b.jsonl.gz", "wt") as f:
        f.write("".join(lines[7:]) + json.dumps({"fr": "only french"}) + "\n")
    return {"teacher": teacher, "shards": shards}


def _args(corpus: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--model", str(corpus["teacher"]), "--train_file", str(corpus["shards"] / "train-*"),
            "--directions", "en-de", "--output_dir", str(out), "--num_beams", "2", "--max_length", "8",
            "--batch_size", "4", "--disable_tqdm", "true", "--max_bad_record_fraction", "0.2", *extra]  # fmt: skip


def _records(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["translation"] for line in f]


def test_shards_in_shards_out_resumable(corpus, tmp_path, monkeypatch, capsys) -> None:
    import trainer.eval.seqkd as seqkd
    from trainer.eval.decode import translate
    from trainer.eval.hf_translate import load_model
    from trainer.tokenizer.vocab import Tokenizer

    out = tmp_path / "out"
    original = seqkd.distill_shard
    calls = []

    def dies_on_the_second(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            (out / ".train-b.jsonl.gz.tmp").write_bytes(b"half a shard")
            raise KeyboardInterrupt  # the kill, after the first shard was committed
        return original(*args, **kwargs)

    monkeypatch.setattr(seqkd, "distill_shard", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        main(_args(corpus, out))
    first = out / "train-a.jsonl"
    assert first.is_file() and not (out / "train-b.jsonl.gz").exists()
    stamp = first.stat().st_mtime_ns, first.stat().st_ino
    monkeypatch.setattr(seqkd, "distill_shard", original)
    assert main(_args(corpus, out)) == 0
    assert (first.stat().st_mtime_ns, first.stat().st_ino) == stamp  # the finished shard: never redone
    assert sorted(p.name for p in out.iterdir()) == ["train-a.jsonl", "train-b.jsonl.gz"]  # no temporary left
    assert "1 of 2 shard(s) to decode (1 finished before)" in capsys.readouterr().err
    assert main(_args(corpus, out)) == 0
    assert "0 of 2 shard(s) to decode" in capsys.readouterr().err

    got = _records(first) + _records(out / "train-b.jsonl.gz")
    inputs = [
        r["translation"]
        for r in map(json.loads, (corpus["shards"] / "train-a.jsonl").read_text().splitlines()[:7])
    ]
    with gzip.open(corpus["shards"] / "train-b.jsonl.gz", "rt") as f:
        inputs += [json.loads(line)["translation"] for line in f if "translation" in line]
    assert [r["en"] for r in got] == [r["en"] for r in inputs] and len(got) == 12
    tok = Tokenizer.load(corpus["teacher"], LANGS)
    import torch

    model = load_model(corpus["teacher"], torch.device("cpu"))
    want = translate(
        model,
        tok,
        [r["en"] for r in inputs],
        "en",
        "de",
        SearchSettings(num_beams=2, max_length=8),
        batch_size=4,
    )
    assert [r["de"] for r in got] == [h.strip() for h in want]
    assert any(r["de"] != i["de"] for r, i in zip(got, inputs))  # the teacher's, not the references


@pytest.mark.parametrize(
    "change,says",
    [
        (("--directions", "en-xx"), "no tag"),
        (("--output_dir", "SHARDS"), "holds the input shards"),
        (("--train_file", "missing/*.jsonl"), "matches no file"),
    ],
    ids=["language", "in-place", "no-shard"],
)
def test_bad_input_is_one_line(corpus, tmp_path, capsys, change, says) -> None:
    args = _args(corpus, tmp_path / "out")
    flag, value = change
    args[args.index(flag) + 1] = str(corpus["shards"]) if value == "SHARDS" else value
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer.distill_data: error:") and says in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("blank", ["some", "all"])
def test_empty_translations_are_left_out_and_named(corpus, tmp_path, monkeypatch, capsys, blank) -> None:
    """An untrained teacher says nothing (EOS first): the trainer would skip those pairs as empty, and
    a shard of nothing but them would stop its reader. They are left out and counted; when every
    translation is empty nothing is written and the run fails in one line."""
    import trainer.eval.runner as runner

    original = runner.translate_on_mesh

    def silent(*args, **kwargs):  # type: ignore[no-untyped-def]
        hyps = original(*args, **kwargs)
        return [h if blank == "some" and i % 2 else "" for i, h in enumerate(hyps)]

    monkeypatch.setattr(runner, "translate_on_mesh", silent)
    out = tmp_path / "out"
    if blank == "all":
        assert main(_args(corpus, out)) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and "all 12 of the teacher's translations are empty" in err[0], err
        assert not any(p.is_file() for p in out.iterdir())
        return
    assert main(_args(corpus, out)) == 0
    err = capsys.readouterr().err
    assert "7 of the teacher's translations were empty and are left out" in err, err  # 4 of 7, 3 of 5
    got = _records(out / "train-a.jsonl") + _records(out / "train-b.jsonl.gz")
    assert len(got) == 5 and all(r["de"] for r in got)
