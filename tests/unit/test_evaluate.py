"""Translation-quality evaluation and the `trainer.translate` CLI.

Evaluation: metrics on known strings, batching, order, per-direction keys, with
`WordTokenizer`, a test double of the `TextTokenizer` interface (word `w17` is id 17).

CLI: a tiny model exported with `save_hf_model` next to a tokenizer directory built
here from a `tokenizers` word-level model wrapped as a `PreTrainedTokenizerFast` (any
`AutoTokenizer`-loadable directory must work, not only those our trainer writes),
with `__en__` / `__fr__` as special tokens; the CLI runs in a subprocess.
"""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.generate import SearchSettings, generate
from models.hf_save import save_hf_model
from models.m2m100 import M2M100Translation
from tests.served import Served
from tests.unit.test_model_parity import CFG
from trainer.eval.decode import (
    SAMPLES_KEY,
    DirectionTexts,
    Sample,
    build_batches,
    evaluate_directions,
    score_directions,
    strip_output,
    translate,
)
from trainer.eval.metrics import bleu_tokenizer, compute_metrics
from trainer.translate import main

VOCAB = 40
LANGS = {"en": 4, "de": 5, "fr": 6}
FIRST_WORD = 7


class WordTokenizer:
    """`w<id>` words; ids 0-3 are <s> <pad> </s> <unk>, 4-6 language tags."""

    pad_id, eos_id = 1, 2

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids if i >= FIRST_WORD)

    def lang_id(self, lang: str) -> int:
        if lang not in LANGS:
            raise KeyError(f"no tag __{lang}__")
        return LANGS[lang]


def sentences(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    return [
        " ".join(f"w{int(i)}" for i in torch.randint(FIRST_WORD, VOCAB, (k,), generator=g)) for k in lengths
    ]


@pytest.fixture(scope="module")
def model() -> M2M100Translation:
    torch.manual_seed(0)
    return M2M100Translation(ModelConfig(**{**CFG, "vocab_size": VOCAB, "init_std": 0.3})).eval()  # type: ignore[arg-type]


def test_identical_strings_score_100() -> None:
    refs = ["the cat sat on the mat", "a quick brown fox jumps"]
    assert compute_metrics(refs, refs) == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0),
                                           "chrf++": pytest.approx(100.0)}  # fmt: skip
    worse = compute_metrics(["the cat sat on a hat", "a slow brown fox jumps"], refs)
    assert 0.0 < worse["bleu"] < 100.0 and 0.0 < worse["chrf"] < 100.0
    assert compute_metrics(["zzz qqq", "xxx"], refs)["bleu"] == pytest.approx(0.0)


def test_metrics_reject_mismatched_or_empty() -> None:
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        compute_metrics(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no sentences"):
        compute_metrics([], [])


def test_bleu_tokenizer_per_target_language() -> None:
    assert bleu_tokenizer("de") == bleu_tokenizer(None) == "13a"
    assert bleu_tokenizer("zh") == bleu_tokenizer("zho_Hans") == "zh"
    assert bleu_tokenizer("ja") in ("ja-mecab", "char") and bleu_tokenizer("kor_Hang") in ("ko-mecab", "char")
    # Without a word segmenter, unsegmented Chinese would be one "word" per sentence under 13a.
    zh = compute_metrics(["我喜欢猫"], ["我喜欢狗"], "zh")
    assert 0.0 < zh["bleu"] < 100.0


def test_batches_are_length_sorted_and_cover_every_sentence() -> None:
    tok = WordTokenizer()
    texts = ["w7", "w8 w9 w10", "", "w11 w12"]
    batches = build_batches(tok, texts, "en", "de", batch_size=3)
    assert [b.index for b in batches] == [[1, 3, 0], [2]]
    first = batches[0]
    assert first.input_ids.tolist() == [[4, 8, 9, 10, 2], [4, 11, 12, 2, 1], [4, 7, 2, 1, 1]]
    assert first.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert first.forced_bos_token_id.tolist() == [5, 5, 5]
    assert build_batches(tok, texts, "en", "de", 4, max_source_length=3)[0].input_ids.shape[1] == 3


def test_strip_output_keeps_only_the_translation() -> None:
    assert strip_output([2, 5, 9, 8, 2, 1, 1], eos_id=2, pad_id=1) == [9, 8]
    assert strip_output([2, 5, 9, 9], eos_id=2, pad_id=1) == [9, 9]  # hit max_length, no EOS


def test_translate_restores_input_order(model) -> None:
    """Length-sorted batches come back in input order: equal to decoding the unsorted batch."""
    tok = WordTokenizer()
    texts = sentences(7, seed=1)
    got = translate(model, tok, texts, "en", "fr", SearchSettings(num_beams=2, max_length=10), len(texts))
    batch = build_batches(tok, texts, "en", "fr", batch_size=len(texts))[0]
    unsorted = torch.empty_like(batch.input_ids)
    unsorted[torch.tensor(batch.index)] = batch.input_ids  # the same padded width, in input order
    out = generate(model, unsorted, (unsorted != tok.pad_id).long(), LANGS["fr"], num_beams=2, max_length=10)
    want = [tok.decode(strip_output(row, tok.eos_id, tok.pad_id)) for row in out.tolist()]
    assert got == want
    assert len(
        translate(model, tok, texts, "en", "fr", SearchSettings(num_beams=1, max_length=10), 3)
    ) == len(texts)


def test_evaluate_directions_keys_samples_and_mode(model) -> None:
    tok = WordTokenizer()
    sets = [
        DirectionTexts(("en", "de"), sentences(5, 2), sentences(5, 3)),
        DirectionTexts(("de", "fr"), sentences(2, 4), sentences(2, 5)),
        DirectionTexts(("fr", "en"), [], []),  # no data: skipped, not an error
    ]
    model.train()
    result = evaluate_directions(model, sets, tok, num_beams=2, max_length=8, batch_size=2, num_samples=3)
    assert model.training, "train/eval mode must be restored"
    model.eval()
    numeric = {k for k in result if k != SAMPLES_KEY}
    assert numeric == {f"eval_{m}{d}" for m in ("bleu", "chrf", "chrf++") for d in ("", "_en-de", "_de-fr")}
    assert result["eval_bleu"] == pytest.approx((result["eval_bleu_en-de"] + result["eval_bleu_de-fr"]) / 2)
    assert result["eval_chrf"] == pytest.approx((result["eval_chrf_en-de"] + result["eval_chrf_de-fr"]) / 2)
    assert result["eval_chrf++"] == pytest.approx(
        (result["eval_chrf++_en-de"] + result["eval_chrf++_de-fr"]) / 2
    )
    samples = result[SAMPLES_KEY]
    assert [s.direction for s in samples] == ["en-de"] * 3 + ["de-fr"] * 2
    assert all(isinstance(s, Sample) for s in samples)
    assert samples[0].source == sets[0].sources[0] and samples[0].reference == sets[0].references[0]


def test_score_directions_scores_only_where_hypotheses_are() -> None:
    """A distributed translator returns None on ranks without hypotheses: nothing scored there."""
    sets = [DirectionTexts(("en", "de"), sentences(4, 2), sentences(4, 3))]
    assert score_directions(lambda sources, src, tgt: None, sets) == {SAMPLES_KEY: []}
    echo = score_directions(lambda sources, src, tgt: list(sets[0].references), sets)
    assert echo["eval_bleu"] == pytest.approx(100.0) and len(echo[SAMPLES_KEY]) == 3


def test_missing_language_tag_raises() -> None:
    with pytest.raises(KeyError, match="__xx__"):
        build_batches(WordTokenizer(), ["w7"], "en", "xx", batch_size=1)


# ----------------------------------------------------------------------------- trainer.translate CLI

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "__en__", "__fr__"]
WORDS = "hello world the cat sat on mat bonjour monde le chat assis sur tapis".split()


def write_tokenizer(out: Path) -> int:
    """A word-level AutoTokenizer directory; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["__en__", "__fr__"],
    )  # fmt: skip
    hf.save_pretrained(str(out))
    return len(vocab)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export")
    vocab_size = write_tokenizer(out)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab_size, d_model=16, encoder_layers=1, decoder_layers=1,
                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                      decoder_ffn_dim=32, max_position_embeddings=64, init_std=0.3)  # fmt: skip
    save_hf_model(M2M100Translation(cfg).state_dict(), cfg, out)
    return out


def test_cli_translates_stdin_line_by_line(served: Served, model_dir: Path) -> None:
    cmd = [served.python, "-m", "trainer.translate", "--model", str(model_dir), "--source_lang", "en",
           "--target_lang", "fr", "--num_beams", "2", "--max_length", "8"]  # fmt: skip
    proc = subprocess.run(cmd, input="hello world\nthe cat sat on the mat\n", capture_output=True,
                          text=True, encoding="utf-8", cwd=ROOT, env=served.environ(), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    assert len(lines) == 3 and lines[2] == "", proc.stdout  # two lines, each newline-terminated
    assert all(w in WORDS for line in lines for w in line.split()), lines


def test_one_process_load_draws_nothing_and_reads_each_tensor_once(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: one-process `trainer.translate` built a randomly initialised full model, then read
    a second full copy of the weights. Now the model is built on meta and each tensor is read
    into it once: no initial weight drawn, the loaded weights equal the directory's."""
    import models.hf
    from models.hf import load_hf_into
    from trainer.eval.hf_translate import load_model

    want = M2M100Translation(models.hf.read_hf_config(model_dir))
    load_hf_into(want, model_dir)
    reads: list[str] = []
    read_part = models.hf._read_part

    def counted(ckpt: object, name: str, *args: object) -> torch.Tensor:
        reads.append(name)
        return read_part(ckpt, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(models.hf, "_read_part", counted)
    monkeypatch.setattr(M2M100Translation, "init_value", None)  # a draw would fail here
    got = load_model(model_dir, torch.device("cpu"))
    params = dict(got.named_parameters())
    assert sorted(reads) == sorted(params), reads  # each parameter read once, nothing else
    assert all(torch.equal(p, want.state_dict()[n]) for n, p in params.items())
    assert not got.training


def test_cli_one_output_line_per_input_line(model_dir: Path) -> None:
    out = io.StringIO()
    argv = ["--model", str(model_dir), "--source_lang", "fr", "--target_lang", "en", "--num_beams", "1"]
    assert main(argv, io.StringIO("le chat\n\nbonjour\n"), out) == 0
    assert len(out.getvalue().split("\n")) == 4  # empty input lines still get an output line


def test_cli_missing_dir_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(tmp_path / "nope"), "--source_lang", "en", "--target_lang", "fr"]
    assert main(argv, io.StringIO(""), io.StringIO()) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a directory" in err and "nope" in err and "\n" not in err


def test_cli_missing_language_lists_available_tags(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(model_dir), "--source_lang", "en", "--target_lang", "de"]
    assert main(argv, io.StringIO("hello\n"), io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "__de__" in err and "__en__" in err and "__fr__" in err, err


# Under torchrun: bad sizes fail on every rank before any process group exists (one line, rank 0).
@pytest.mark.parametrize(
    ("world", "flags", "expected"),
    [
        (4, ["--pipeline_parallel_size", "2", "--data_parallel_size", "1"], "!= WORLD_SIZE(4)"),
        (
            4,
            ["--pipeline_parallel_size", "3"],
            "pipeline_parallel_size=3 does not divide 4 ranks; valid: 1, 2, 4",
        ),
        (
            4,
            ["--tensor_parallel_size", "4"],
            "tensor_parallel_size=4 does not divide encoder_attention_heads(2)",
        ),
        (8, ["--pipeline_parallel_size", "8"], "pipeline_parallel_size=8 but the model has only 6 blocks"),
        (2, ["--device", "cuda:1"], "names one GPU"),
        (1, ["--tensor_parallel_size", "2"], "does not divide 1 rank"),
    ],
)
def test_cli_bad_mesh_is_one_clear_line_before_any_group(
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    flags: list[str],
    expected: str,
) -> None:
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    argv = ["--model", str(model_dir), "--source_lang", "en", "--target_lang", "fr", *flags]
    assert main(argv, io.StringIO("hello\n"), io.StringIO()) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err, err
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "1")  # the other ranks fail alike, silently
    assert main(argv, io.StringIO("hello\n"), io.StringIO()) == 2
    assert capsys.readouterr().err == ""


def test_cli_dtype_casts_every_weight_and_decodes(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--dtype` (transformers' name): the weights load in that precision and decode in it;
    `auto` follows config.json; a bad name is one line, exit 2."""
    from trainer.eval.hf_translate import load_model, resolve_dtype

    model = load_model(model_dir, torch.device("cpu"), torch.bfloat16)
    assert {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()} == {
        torch.bfloat16
    }
    for dtype in ("bfloat16", "float16", "auto"):
        out = io.StringIO()
        argv = ["--model", str(model_dir), "--source_lang", "en", "--target_lang", "fr", "--dtype", dtype]
        assert main(argv, io.StringIO("hello world\nthe cat\n"), out) == 0
        lines = out.getvalue().split("\n")
        assert len(lines) == 3 and all(w in WORDS for line in lines for w in line.split()), (dtype, lines)
    assert resolve_dtype("auto", model_dir) == torch.float32  # save_hf_model records float32
    capsys.readouterr()  # the translations' progress bars
    argv = ["--model", str(model_dir), "--source_lang", "en", "--target_lang", "fr", "--dtype", "fp8"]
    assert main(argv, io.StringIO("hello\n"), io.StringIO()) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainer.translate: error: --dtype 'fp8' is not valid") and "\n" not in err, err
