"""The HF-way tokenizer (issue 12, items 1 and 2).

Export (`python -m trainer.export` of a tiny BPE run): an en-de run becomes a stock M2M100
checkpoint (`M2M100Tokenizer`, `src_lang = "en"`, the vocabulary permuted to its ids), an
eng_Latn-deu_Latn run an `NllbTokenizer` on our ids. Either honours `src_lang` / `tgt_lang` /
`text_target`, truncates at the model's positions, cannot be tag-injected by text, gives
our model's logits on the corresponding ids, drives `generate` with a forced BOS exactly
like our own `models.generate.generate`, and imports back for a fine-tune. A Unigram run's
HF files are a plain fast tokenizer that transformers 4.x can load too. The 4.x round trip
runs `scripts/check_hf_export.py` under `$HF4_PYTHON` (skipped without it).

Stock tokenizers: directories holding an `NllbTokenizer` (`eng_Latn` codes) or an
`M2M100Tokenizer` (`en` -> `__en__`), built here from a tiny SentencePiece model, serve
as `tokenizer_name` for a fine-tune; training on `train.eng_Latn.gz` files gives the run
an `eng_Latn` tag.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from models.config import ModelConfig
from models.generate import generate
from models.hf import load_hf_weights, load_into, read_hf_config
from models.m2m100 import M2M100Translation, Seq2SeqBatch
from tests.corpus_data import read_lines
from tests.unit.test_export_errors import write_run
from trainer.export import main as export_main
from trainer.tokenizer.stock_m2m100 import run_layout, stock_codes
from trainer.tokenizer.vocab import HFTokenizer, SentencePieceTokenizer, Tokenizer, lang_tag, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MAX_POSITIONS = 64  # write_run's model: the export's model_max_length
TEXTS = ["A dog runs in the snow.", "Two men play football."]
TARGETS = ["Ein Hund rennt im Schnee.", "Zwei Männer spielen Fußball."]


@pytest.fixture(scope="module")
def corpus(multi30k: Path) -> list[str]:
    return read_lines(multi30k, "train", "en", 400) + read_lines(multi30k, "train", "de", 400)


class Export(NamedTuple):
    """A tiny BPE run exported by `trainer.export`, and how its ids map to the export's."""

    tok: SentencePieceTokenizer
    run: Path
    out: Path
    src: str  # what src_lang takes: "en" (M2M100Tokenizer) or "eng_Latn" (NllbTokenizer)
    tgt: str
    tokenizer_class: str
    new_id: tuple[int, ...]  # our id -> the export's (the identity for the NllbTokenizer form)

    def to_hf(self, ids: list[int]) -> list[int]:
        return [self.new_id[i] for i in ids]


@pytest.fixture(scope="module", params=[("en", "de"), ("eng_Latn", "deu_Latn")], ids=["m2m100", "nllb"])
def exported(
    request: pytest.FixtureRequest, corpus: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Export:
    src, tgt = request.param
    tok = train_tokenizer(corpus, [src, tgt], 400, model_type="bpe")
    run = write_run(tmp_path_factory.mktemp("run"), tok)
    out = run.parent / f"{run.name}-hf"
    assert export_main(["--checkpoint", str(run / "checkpoint-3"), "--output", str(out)]) == 0
    layout = run_layout(tok, _config(run).vocab_size)
    assert (layout is None) == (src == "eng_Latn")  # stock M2M100 codes: the M2M100 form
    if layout is None:
        return Export(tok, run, out, src, tgt, "NllbTokenizer", tuple(range(_config(run).vocab_size)))
    return Export(tok, run, out, src, tgt, "M2M100Tokenizer", layout.new_id)


def _config(run: Path) -> ModelConfig:
    return ModelConfig.from_dict(
        json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())["model_config"]
    )


def _source(tok: Tokenizer, tag: str, text: str) -> list[int]:
    return [tok._piece_to_id(tag) or -1, *tok.encode(text), tok.eos_id]


def lang_id(hf: Any, code: str) -> int:
    """The id `forced_bos_token_id` takes: `get_lang_id` (M2M100Tokenizer) or the code's token id (NLLB)."""
    return int(hf.get_lang_id(code) if hasattr(hf, "get_lang_id") else hf.convert_tokens_to_ids(code))


def test_export_honours_src_lang_tgt_lang_text_target(exported: Export) -> None:
    from transformers import AutoConfig, AutoTokenizer

    e, tok = exported, exported.tok
    src, tgt = lang_tag(e.src), lang_tag(e.tgt)
    hf = AutoTokenizer.from_pretrained(str(e.out))
    assert (
        type(hf).__name__.removesuffix("Fast") == e.tokenizer_class and hf.model_max_length == MAX_POSITIONS
    )
    vocab = AutoConfig.from_pretrained(str(e.out)).vocab_size
    if e.tokenizer_class == "NllbTokenizer":
        assert (
            len(hf) == tok.vocab_size and vocab == tok.vocab_size + 1
        )  # no <mask> past the model's vocabulary
    else:  # vocab.json: specials + pieces (N); then stock's 100 codes, then 8 madeup words (a padded row)
        n = tok.vocab_size - 2
        assert len(hf) == n and vocab == n + 100 + 8 and hf.get_lang_id("en") == n + stock_codes().index("en")
    hf.src_lang, hf.tgt_lang = e.src, e.tgt
    enc = hf(TEXTS, text_target=TARGETS)
    assert enc["input_ids"] == [e.to_hf(_source(tok, src, t)) for t in TEXTS]  # [src] tokens </s>
    assert enc["labels"] == [e.to_hf(_source(tok, tgt, t)) for t in TARGETS]  # [tgt] tokens </s>
    assert enc["input_ids"][0][0] == lang_id(hf, e.src) and enc["labels"][0][0] == lang_id(hf, e.tgt)
    hf.src_lang = e.tgt  # the setter switches the prefix, as in stock M2M100 / NLLB
    assert hf(TARGETS[0])["input_ids"] == e.to_hf(_source(tok, tgt, TARGETS[0]))
    assert hf.decode(enc["labels"][1], skip_special_tokens=True) == tok.decode(tok.encode(TARGETS[1]))


def test_export_truncates_and_cannot_be_injected(exported: Export) -> None:
    """split_special_tokens: a text spelling a tag or </s> gives the pieces SentencePiece gives
    (without it, both majors' M2M100Tokenizer read `</s>` in text as eos)."""
    from transformers import AutoTokenizer

    e, tok = exported, exported.tok
    src, tgt = lang_tag(e.src), lang_tag(e.tgt)
    hf = AutoTokenizer.from_pretrained(str(e.out))
    hf.src_lang = e.src
    ids = hf(" ".join(TEXTS) * 30, truncation=True)["input_ids"]
    assert len(ids) == MAX_POSITIONS and ids[0] == lang_id(hf, e.src) and ids[-1] == tok.eos_id
    tags = {lang_id(hf, code) for code in (e.src, e.tgt)}
    for text in [f"{tgt} {TEXTS[0]}", f"x {src}y", f"a </s> b <pad> {tgt}"]:
        ids = hf(text)["input_ids"]
        assert ids == e.to_hf(_source(tok, src, text)), text  # the same pieces as our SentencePiece encode
        assert tags & set(ids[1:]) == set() and tok.eos_id not in ids[:-1] and tok.pad_id not in ids, text
    if e.tokenizer_class == "M2M100Tokenizer":  # the SentencePiece model itself: whitespace as ours too
        odd = ["  two  spaces  ", "trailing ", "\ttab and\nnewline", "Ünïcödé ✓ 漢字", "", " "]
        assert hf(odd, add_special_tokens=False)["input_ids"] == [e.to_hf(x) for x in tok.encode_batch(odd)]


def test_export_logits_and_generate_with_forced_bos_match_ours(exported: Export) -> None:
    """The export on its ids == our model on ours: logits (permuted, 1e-5), greedy tokens, text."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    e, tok = exported, exported.tok
    ours = M2M100Translation(_config(e.run)).eval()
    ours.load_state_dict(torch.load(e.run / "reference.pt"))
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(e.out)).eval()
    htok = AutoTokenizer.from_pretrained(str(e.out))
    htok.src_lang = e.src
    batch = htok(TEXTS, return_tensors="pt", padding=True)
    our_ids = torch.tensor([_source(tok, lang_tag(e.src), t) for t in TEXTS[:1]])
    dec = torch.tensor([[tok.eos_id, tok.lang_id(e.tgt), *tok.encode(TARGETS[0])]])
    forced = lang_id(htok, e.tgt)
    with torch.no_grad():
        theirs = hf.generate(**batch, forced_bos_token_id=forced, num_beams=1, do_sample=False, max_length=12)
        mine = generate(ours, _our_batch(e, batch["input_ids"]), batch["attention_mask"], tok.lang_id(e.tgt),
                        num_beams=1, max_length=12)  # fmt: skip
        mapped = torch.tensor(e.new_id)
        got = hf(input_ids=mapped[our_ids], decoder_input_ids=mapped[dec]).logits[..., mapped]
        want = ours(Seq2SeqBatch(our_ids, torch.ones_like(our_ids), dec, torch.full_like(dec, -100)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (theirs[:, :2] == torch.tensor([tok.eos_id, forced])).all()  # </s> [tgt] ...
    assert _rows(theirs, tok.pad_id) == [e.to_hf(r) for r in _rows(mine, tok.pad_id)]
    assert htok.batch_decode(theirs, skip_special_tokens=True) == [tok.decode(r) for r in mine.tolist()]


def _our_batch(e: Export, hf_ids: torch.Tensor) -> torch.Tensor:
    """The export's ids -> ours (the inverse of `new_id`)."""
    back = {new: ours for ours, new in enumerate(e.new_id)}
    return torch.tensor([[back[int(i)] for i in row] for row in hf_ids])


def test_export_imports_back_for_fine_tuning(exported: Export) -> None:
    """`tokenizer_name` / `model_name_or_path` = the export: our tokenizer and model on its ids."""
    from transformers import AutoModelForSeq2SeqLM

    e, tok = exported, exported.tok
    again = Tokenizer.load(e.out, [e.src, e.tgt])
    assert isinstance(again, HFTokenizer) and again.encode_batch(TEXTS) == [
        e.to_hf(x) for x in tok.encode_batch(TEXTS)
    ]
    assert again.lang_id(e.tgt) == lang_id(again.hf, e.tgt) == e.new_id[tok.lang_id(e.tgt)]
    model = M2M100Translation(read_hf_config(e.out)).eval()
    load_into(model, load_hf_weights(e.out))
    src = torch.tensor([_source(again, lang_tag(e.src), TEXTS[0])])
    dec = torch.tensor([[again.eos_id, again.lang_id(e.tgt), *again.encode(TARGETS[0])]])
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(e.out)).eval()
    with torch.no_grad():
        want = hf(input_ids=src, decoder_input_ids=dec).logits
        got = model(Seq2SeqBatch(src, torch.ones_like(src), dec, torch.full_like(dec, -100)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.dist
@pytest.mark.slow
def test_fine_tune_from_the_export(exported: Export, tmp_path: Path, multi30k: Path) -> None:
    """3 steps (one process) with the export as `model_name_or_path` and `tokenizer_name`: the
    loss falls, and the run's tokenizer keeps the export's ids (M2M100: `__de__` past the pieces)."""
    from tests.dist.harness import run_distributed
    from tests.dist.train_workers import base_config, train_cases

    e = exported
    base = base_config(
        str(tmp_path), max_steps=3, builtin_size=200, max_source_length=32, max_target_length=32,
        model_name_or_path=str(e.out), tokenizer_name=str(e.out), language_pairs=[f"{e.src}-{e.tgt}"],
    )  # fmt: skip
    if e.src == "eng_Latn":  # the built-in corpus is en-de: the same text under NLLB codes
        for code, lang in ((e.src, "en"), (e.tgt, "de")):
            with gzip.open(tmp_path / f"train.{code}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(read_lines(multi30k, "train", lang, 200)) + "\n")
        base.update(dataset_name=None, train_file=str(tmp_path / "train.{lang}.gz"))
    (hist,) = run_distributed(train_cases, 1, (base, [{}]), timeout=240)[0]
    assert hist and len(hist) == 3 and all(loss == loss and loss > 0 for _, loss, _ in hist), hist
    assert hist[-1][1] < hist[0][1], hist
    tok = Tokenizer.load(tmp_path / "run-0" / "tokenizer", [e.src, e.tgt])
    assert tok.lang_id(e.tgt) == e.new_id[e.tok.lang_id(e.tgt)]  # the export's ids, kept by the fine-tune


def _rows(ids: torch.Tensor, pad: int) -> list[list[int]]:
    return [[int(i) for i in row if int(i) != pad] for row in ids]


def test_export_round_trip_in_transformers4(exported: Export, tmp_path: Path) -> None:
    """Build the venv with: python -m venv V && V/bin/pip install torch transformers==4.57.* sentencepiece."""
    python = os.environ.get("HF4_PYTHON")
    if not python:
        pytest.skip("HF4_PYTHON is not set: no Python with transformers 4.x to load the export with")
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    e = exported
    hf = AutoTokenizer.from_pretrained(str(e.out))
    hf.src_lang, hf.tgt_lang = e.src, e.tgt
    enc = hf(TEXTS, text_target=TARGETS)
    model = AutoModelForSeq2SeqLM.from_pretrained(str(e.out)).eval()
    batch = hf(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, forced_bos_token_id=lang_id(hf, e.tgt), num_beams=1, max_length=12)
        generated = _rows(out, 1)
        dec = torch.tensor([generated[0]])
        logits = model(input_ids=batch["input_ids"][:1], decoder_input_ids=dec).logits[0]
    expected: dict[str, Any] = dict(
        tokenizer_class=e.tokenizer_class, src_lang=e.src, tgt_lang=e.tgt, texts=TEXTS, targets=TARGETS,
        input_ids=enc["input_ids"], labels=enc["labels"], plain_ids=[e.to_hf(x) for x in e.tok.encode_batch(TEXTS)],
        model_max_length=MAX_POSITIONS, generated=generated, logits=logits.tolist(),
    )  # fmt: skip
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    res = subprocess.run(
        [python, str(ROOT / "scripts" / "check_hf_export.py"), str(e.out), str(tmp_path / "expected.json")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert "transformers 4." in res.stdout, res.stdout
    print(res.stdout)  # e.g. "transformers 4.57.6: M2M100Tokenizer, ..." and "9 passed, 0 failed" (pytest -s)


def test_unigram_export_is_a_plain_fast_tokenizer_both_majors_load(corpus: list[str], tmp_path: Path) -> None:
    """transformers 5 rebuilds NllbTokenizer as BPE, so a Unigram run keeps the plain form:
    `tokenizer_class` PreTrainedTokenizerFast (4.x has no TokenizersBackend), the tag written in the text."""
    from transformers import AutoTokenizer

    tok = train_tokenizer(corpus, ["de", "en"], 400, model_type="unigram")
    tok.save_pretrained(tmp_path, model_max_length=16)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "backend" not in config
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf("__en__ " + TEXTS[0])["input_ids"] == _source(tok, "__en__", TEXTS[0])
    assert len(hf(" ".join(TEXTS) * 10, truncation=True)["input_ids"]) == 16


def test_nllb_codes_are_their_own_tags(corpus: list[str]) -> None:
    assert (lang_tag("en"), lang_tag("eng_Latn"), lang_tag("zho_Hant"), lang_tag("en_XX")) == (
        "__en__", "eng_Latn", "zho_Hant", "__en_XX__",
    )  # fmt: skip
    tok = train_tokenizer(corpus, ["eng_Latn", "deu_Latn"], 400)
    assert [tok.lang_id("deu_Latn"), tok.lang_id("eng_Latn")] == [4, 5]
    assert not {4, 5} & set(tok.encode("eng_Latn deu_Latn __en__"))  # control symbols: never from text


def _spm(corpus: list[str]) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=buf, vocab_size=300, model_type="bpe", minloglevel=2,
        hard_vocab_limit=False,
    )  # fmt: skip
    return buf.getvalue()


def stock_nllb(corpus: list[str], path: Path) -> Path:
    """An NllbTokenizer directory as transformers builds one from a SentencePiece model: pieces,
    then `<mask>` and the language codes appended."""
    from transformers import NllbTokenizer

    spm_dir = path.parent / f"{path.name}-spm"
    spm_dir.mkdir(parents=True)
    (spm_dir / "sentencepiece.bpe.model").write_bytes(_spm(corpus))
    codes = ["deu_Latn", "eng_Latn", "fra_Latn"]
    NllbTokenizer.from_pretrained(str(spm_dir), additional_special_tokens=codes).save_pretrained(str(path))
    return path


def stock_m2m100(corpus: list[str], path: Path) -> Path:
    """An M2M100Tokenizer directory: vocab.json (specials, then the pieces) + the SentencePiece
    model; its 100 `__xx__` tokens follow the vocabulary."""
    import sentencepiece as spm
    from transformers import M2M100Tokenizer

    proto = _spm(corpus)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        vocab.setdefault(sp.id_to_piece(i), len(vocab))
    path.mkdir(parents=True)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "spm.model").write_bytes(proto)
    M2M100Tokenizer(str(path / "vocab.json"), str(path / "spm.model")).save_pretrained(str(path))
    return path


def test_stock_nllb_and_m2m100_tokenizers_load(corpus: list[str], tmp_path: Path) -> None:
    nllb = Tokenizer.load(stock_nllb(corpus, tmp_path / "nllb"), ["eng_Latn", "deu_Latn"])
    assert isinstance(nllb, HFTokenizer) and nllb.languages == ["deu_Latn", "eng_Latn"]
    assert nllb.lang_id("eng_Latn") == nllb.hf.convert_tokens_to_ids("eng_Latn") >= 300
    assert nllb.encode("eng_Latn") == nllb.hf(
        "eng_Latn", add_special_tokens=False, split_special_tokens=True
    )["input_ids"] and nllb.lang_id("eng_Latn") not in nllb.encode("x eng_Latn y")
    with pytest.raises(ValueError, match=r"has no tag __en__; it has \['deu_Latn', 'eng_Latn', 'fra_Latn'\]"):
        Tokenizer.load(tmp_path / "nllb", ["en"])
    m2m = Tokenizer.load(stock_m2m100(corpus, tmp_path / "m2m"), ["en", "de"])
    en = m2m.lang_id("en")
    assert en == m2m.hf.get_lang_id("en") and m2m.vocab_size > en  # tags lie past len(vocab.json)
    assert en not in m2m.encode("__en__ hello") and len(m2m.available_tags()) == 100
    assert m2m.decode([en, *m2m.encode(TEXTS[0]), m2m.eos_id]) == m2m.hf.decode(
        m2m.encode(TEXTS[0]), skip_special_tokens=True
    )


def test_stock_tokenizers_re_exported_load_in_both_majors(corpus: list[str], tmp_path: Path) -> None:
    """A fine-tune from a stock tokenizer exports it with `save_pretrained`; transformers 5 writes
    the codes as a list `extra_special_tokens` that 4.x cannot read, so they become
    `additional_special_tokens`. Loaded in 4.x too when `HF4_PYTHON` is set."""
    cases = [
        (stock_nllb(corpus, tmp_path / "nllb"), ["eng_Latn", "deu_Latn"], "eng_Latn"),
        (stock_m2m100(corpus, tmp_path / "m2m"), ["en", "de"], "en"),
    ]
    for path, langs, src in cases:
        tok = Tokenizer.load(path, langs)
        out = tmp_path / f"{path.name}-export"
        tok.save_pretrained(out, model_max_length=32)
        config = json.loads((out / "tokenizer_config.json").read_text())
        assert not isinstance(config.get("extra_special_tokens"), list), config.get("extra_special_tokens")
        again = Tokenizer.load(out, langs)
        assert again.encode(TEXTS[0]) == tok.encode(TEXTS[0]) and again.lang_id(src) == tok.lang_id(src)
        python = os.environ.get("HF4_PYTHON")
        if python:
            code = (
                "import sys; from transformers import AutoTokenizer as A; t = A.from_pretrained(sys.argv[1]); "
                "t.src_lang = sys.argv[2]; print(t(sys.argv[3])['input_ids'], t.model_max_length)"
            )
            res = subprocess.run(
                [python, "-c", code, str(out), src, TEXTS[0]], capture_output=True, text=True, timeout=120,
                env={**os.environ, "PYTHONPATH": ""},
            )  # fmt: skip
            assert res.returncode == 0, res.stderr[-2000:]
            assert res.stdout.split()[-1] == "32", res.stdout
            assert json.loads(res.stdout.rsplit(" ", 1)[0]) == _source(tok, lang_tag(src), TEXTS[0]), (
                res.stdout
            )


@pytest.mark.dist
@pytest.mark.slow
def test_finetune_with_stock_tokenizers_and_nllb_files(
    corpus: list[str], tmp_path: Path, multi30k: Path
) -> None:
    """One process, 3 steps each: an NllbTokenizer dir on `train.{eng_Latn,deu_Latn}.gz`, an
    M2M100Tokenizer dir on the built-in en-de corpus, and our own tokenizer trained on the NLLB files."""
    from tests.dist.harness import run_distributed
    from tests.dist.train_workers import base_config, train_cases

    for code, lang in (("eng_Latn", "en"), ("deu_Latn", "de")):
        with gzip.open(tmp_path / f"train.{code}.gz", "wt", encoding="utf-8") as f:
            f.write("\n".join(read_lines(multi30k, "train", lang, 200)) + "\n")
    nllb_dir = stock_nllb(corpus, tmp_path / "nllb")
    m2m_dir = stock_m2m100(corpus, tmp_path / "m2m")
    files = dict(
        dataset_name=None, train_file=str(tmp_path / "train.{lang}.gz"), language_pairs=["eng_Latn-deu_Latn"]
    )
    base = base_config(str(tmp_path), max_steps=3, builtin_size=200, spm_model_type="bpe")
    cases = [
        {**files, "tokenizer_name": str(nllb_dir), "output_dir": str(tmp_path / "nllb-run")},
        {
            "tokenizer_name": str(m2m_dir),
            "language_pairs": ["en-de"],
            "output_dir": str(tmp_path / "m2m-run"),
        },
        {**files, "output_dir": str(tmp_path / "own-run")},
    ]
    histories = run_distributed(train_cases, 1, (base, cases), timeout=240)[0]
    for hist in histories:
        assert hist and len(hist) == 3 and all(loss == loss and loss > 0 for _, loss, _ in hist), hist
    nllb_run = Tokenizer.load(tmp_path / "nllb-run" / "tokenizer", ["eng_Latn", "deu_Latn"])
    assert nllb_run.lang_id("eng_Latn") == Tokenizer.load(nllb_dir).lang_id("eng_Latn")
    m2m_run = Tokenizer.load(tmp_path / "m2m-run" / "tokenizer", ["en", "de"])
    assert m2m_run.lang_id("en") == Tokenizer.load(m2m_dir).lang_id("en")
    own = Tokenizer.load(tmp_path / "own-run" / "tokenizer", ["eng_Latn", "deu_Latn"])
    assert isinstance(own, SentencePieceTokenizer) and own.available_tags() == ["deu_Latn", "eng_Latn"]
    assert [own.lang_id("deu_Latn"), own.lang_id("eng_Latn")] == [4, 5]
