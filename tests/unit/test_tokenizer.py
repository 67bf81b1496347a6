"""The shared SentencePiece tokenizer: id layout, control-symbol tags, save/load, HF export."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.corpus_data import read_lines
from trainer.errors import TokenizerError
from trainer.tokenizer.vocab import HFTokenizer, SentencePieceTokenizer, Tokenizer, train_tokenizer

LANGS = ["cs", "de", "en", "fr"]


@pytest.fixture(scope="module")
def texts(multi30k: Path) -> list[str]:
    return [t for lang in LANGS for t in read_lines(multi30k, "train", lang, 1000)]


@pytest.fixture(scope="module", params=["unigram", "bpe"])
def tok(request: pytest.FixtureRequest, texts: list[str]) -> SentencePieceTokenizer:
    return train_tokenizer(texts, LANGS, 2000, model_type=request.param, seed=0)


@pytest.fixture(scope="module")
def val_texts(multi30k: Path) -> list[str]:
    extra = ["  two  spaces ", "日本語", "Ｆｕｌｌ ＡＢＣ", "tab\there", "ﬁ Ⅻ", "a__x__b"]
    return [t for lang in LANGS for t in read_lines(multi30k, "val", lang, 300)] + extra


def test_special_ids_and_tag_layout(tok: SentencePieceTokenizer) -> None:
    assert (tok.bos_id, tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert [tok.lang_id(lang) for lang in LANGS] == [4, 5, 6, 7]  # sorted, right after the specials
    assert tok.special_ids() == {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "unk_token_id": 3,
                                 "decoder_start_token_id": 2}  # fmt: skip
    assert tok.vocab_size == 2000


def test_text_cannot_inject_a_tag(tok: SentencePieceTokenizer) -> None:
    tags = {tok.lang_id(lang) for lang in LANGS}
    for text in ["__en__", "__fr__ bonjour", "x __de__ y", "<s> </s> <pad>"]:
        ids = tok.encode(text)
        assert not tags & set(ids), text
        assert not {0, 1, 2} & set(ids), text


def test_round_trip_and_decode_skips_specials(tok: SentencePieceTokenizer) -> None:
    text = "A man in a blue shirt is standing on a ladder."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([tok.lang_id("en"), *ids, tok.eos_id, tok.pad_id, -100]) == text


def test_unknown_language_error_names_tags(tok: SentencePieceTokenizer) -> None:
    with pytest.raises(TokenizerError, match=r"__ja__.*\['__cs__', '__de__', '__en__', '__fr__'\]"):
        tok.lang_id("ja")


def test_deterministic(texts: list[str], tok: SentencePieceTokenizer) -> None:
    again = train_tokenizer(texts, LANGS, 2000, model_type=_model_type(tok), seed=0)
    assert again.model_proto == tok.model_proto


def test_deterministic_across_processes_when_sampling(multi30k: Path) -> None:
    """More texts than input_sentence_size: the sample is drawn by the seed, not by SentencePiece,
    whose own draw differed between processes (two runs of one config trained different pieces,
    so a streaming run and its restarted twin disagreed from step 1)."""
    import subprocess
    import sys

    code = (
        "import gzip, hashlib; from trainer.tokenizer.vocab import train_tokenizer; "
        f"t = [l for x in {LANGS!r} for l in gzip.open({str(multi30k)!r} + '/train.' + x + '.gz', 'rt').read().splitlines()[:600]]; "
        f"print(hashlib.md5(train_tokenizer(t, {LANGS!r}, 500, 'bpe', 1.0, 1000, 3).model_proto).hexdigest())"
    )
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}  # fmt: skip
    assert len(runs) == 1, runs


def _model_type(tok: SentencePieceTokenizer) -> str:
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(tok.model_proto)
    return "bpe" if proto.trainer_spec.model_type == 2 else "unigram"


def test_tiny_corpus_shrinks_vocab_and_tiny_vocab_fails(texts: list[str]) -> None:
    small = train_tokenizer(texts[:40], LANGS, 8000)
    assert 8 < small.vocab_size < 8000
    with pytest.raises(TokenizerError, match="vocab_size=10 is too small"):
        train_tokenizer(texts[:40], LANGS, 10)
    with pytest.raises(TokenizerError, match="empty"):
        train_tokenizer(["", "  "], LANGS, 100)


def test_save_load(tok: SentencePieceTokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    loaded = Tokenizer.load(tmp_path, ["en", "de"])
    assert isinstance(loaded, SentencePieceTokenizer)
    assert loaded.encode("Two dogs play.") == tok.encode("Two dogs play.")
    assert loaded.lang_id("fr") == tok.lang_id("fr")
    with pytest.raises(TokenizerError, match=r"has no tag __ja__; it has \['__cs__'"):
        Tokenizer.load(tmp_path, ["en", "ja"])
    with pytest.raises(TokenizerError, match="is not a directory"):
        Tokenizer.load(tmp_path / "nope", ["en"])


def test_hf_autotokenizer_round_trip(
    tok: SentencePieceTokenizer, val_texts: list[str], tmp_path: Path
) -> None:
    """The run's HF files: BPE an NllbTokenizer (tags via src_lang, never from text), Unigram a plain
    fast one (`trainer.export` writes an M2M100Tokenizer instead for stock M2M100 codes)."""
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    bpe = _model_type(tok) == "bpe"
    assert type(hf).__name__ in (
        ("NllbTokenizer", "NllbTokenizerFast") if bpe else ("TokenizersBackend", "PreTrainedTokenizerFast")
    )
    # transformers 5 rebuilds NllbTokenizer's normalizer without SentencePiece's trailing-space strip
    texts = [t.rstrip() for t in val_texts] if bpe else val_texts
    ours = tok.encode_batch(texts)
    theirs = hf(texts, add_special_tokens=False)["input_ids"]
    assert ours == theirs
    for lang in LANGS:
        assert hf.convert_tokens_to_ids(f"__{lang}__") == tok.lang_id(lang)
    text = "Ein Hund läuft im Schnee."
    source = [tok.lang_id("de"), *tok.encode(text), tok.eos_id]
    if bpe:
        hf.src_lang = "__de__"
        assert hf(text)["input_ids"] == source
        assert hf("__de__ " + text)["input_ids"] == [
            tok.lang_id("de"),
            *tok.encode("__de__ " + text),
            tok.eos_id,
        ]
    else:  # how a user builds our source format on the plain tokenizer
        assert hf("__de__ " + text)["input_ids"] == source
    assert tok.lang_id("en") not in tok.encode("a__en__b")
    for ids in ours[:200]:
        assert hf.decode(source[:1] + ids + [tok.eos_id], skip_special_tokens=True) == tok.decode(ids)


def test_hf_directory_as_tokenizer_name(tok: SentencePieceTokenizer, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path)
    loaded = Tokenizer.load(tmp_path, ["en", "fr"])
    assert isinstance(loaded, HFTokenizer)
    assert loaded.encode("A cat.") == tok.encode("A cat.")
    assert loaded.special_ids() == tok.special_ids() and loaded.vocab_size == tok.vocab_size
    assert loaded.lang_id("fr") == tok.lang_id("fr")
    with pytest.raises(TokenizerError, match=rf"tokenizer at {tmp_path} has no tag __ja__; it has \["):
        Tokenizer.load(tmp_path, ["ja"])
