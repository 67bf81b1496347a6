"""`python -m trainer.evaluate` in one process: FLORES-style files, directions, the table, bad input.

The model is test_evaluate's tiny random HF directory (a word-level `AutoTokenizer` with
`__en__` / `__fr__`); the data a directory of per-language files written here. The goal test
(the same table through a pp2 x tp2 mesh as in one process) is tests/dist/test_evaluate_3d.py.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import sacrebleu
import torch

from trainer.eval.flores import (
    EvaluateError,
    parse_directions,
    read_language_files,
    resolve_pattern,
)
from trainer.eval.report import averages, build_result, groups_of, to_markdown
from trainer.evaluate import main

EN = ["hello world", "the cat sat on mat", "world", "the mat", "cat sat", "hello the cat"]
FR = ["bonjour monde", "le chat assis sur tapis", "monde", "le tapis", "chat assis", "bonjour le chat"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.config import ModelConfig
    from models.hf_save import save_hf_model
    from models.m2m100 import M2M100Translation
    from tests.unit.test_evaluate import write_tokenizer

    out = tmp_path_factory.mktemp("export")
    vocab_size = write_tokenizer(out)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab_size, d_model=16, encoder_layers=1, decoder_layers=1,
                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                      decoder_ffn_dim=32, max_position_embeddings=64, init_std=0.3)  # fmt: skip
    save_hf_model(M2M100Translation(cfg).state_dict(), cfg, out)
    return out


def write_files(root: Path, pattern: str, texts: dict[str, list[str]]) -> Path:
    for lang, lines in texts.items():
        path = root / pattern.format(lang=lang)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return root


@pytest.fixture
def flores(tmp_path: Path) -> Path:
    """FLORES-200's layout: DIR/devtest/<lang>.devtest."""
    return write_files(tmp_path / "flores", "devtest/{lang}.devtest", {"en": EN, "fr": FR})


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from sacrebleu.tokenizers import tokenizer_spm

    cache = tmp_path / "sacrebleu"
    monkeypatch.setenv("SACREBLEU", str(cache))
    monkeypatch.setattr(tokenizer_spm, "SACREBLEU_DIR", str(cache))
    return cache


# ----------------------------------------------------------------------------- data


def test_directions_from_a_list_or_every_pair_of_languages() -> None:
    assert parse_directions(None, ["en", "de", "fr"]) == [
        ("en", "de"), ("en", "fr"), ("de", "en"), ("de", "fr"), ("fr", "en"), ("fr", "de"),
    ]  # fmt: skip
    assert parse_directions(["eng_Latn-deu_Latn", "de-en", "de-en"], None) == [
        ("eng_Latn", "deu_Latn"),
        ("de", "en"),
    ]


@pytest.mark.parametrize(
    ("directions", "languages", "message"),
    [
        (None, None, "neither was given"),
        (["en-de"], ["en", "de"], "not both"),
        (["en_de"], None, "'en_de' is not a direction; write SRC-TGT"),
        (["en-en"], None, "'en-en' is not a direction"),
        (["en-de-fr"], None, "'en-de-fr' is not a direction"),
        (None, ["en", "en"], "give two or more different languages"),
    ],
)
def test_bad_directions_are_one_line(
    directions: list[str] | None, languages: list[str] | None, message: str
) -> None:
    with pytest.raises(EvaluateError, match=message) as err:
        parse_directions(directions, languages)
    assert "\n" not in str(err.value)


def test_default_pattern_finds_flores_layouts_and_an_explicit_one_is_taken(tmp_path: Path) -> None:
    flores = write_files(tmp_path / "a", "devtest/{lang}.devtest", {"en": EN})
    assert resolve_pattern(flores, None, ["en"]) == "devtest/{lang}.devtest"
    assert resolve_pattern(flores / "devtest", None, ["en"]) == "{lang}.devtest"
    dev = write_files(tmp_path / "b", "dev/{lang}.dev", {"en": EN})
    assert resolve_pattern(dev, None, ["en"]) == "dev/{lang}.dev"
    assert resolve_pattern(dev, "{lang}.txt", ["en"]) == "{lang}.txt"
    with pytest.raises(
        EvaluateError, match=r"no file for language 'de' .*tried de.devtest, devtest/de.devtest"
    ):
        resolve_pattern(flores, None, ["de"])
    with pytest.raises(EvaluateError, match=r"--file_pattern 'test.txt' has no \{lang\}"):
        resolve_pattern(flores, "test.txt", ["en"])
    with pytest.raises(EvaluateError, match=r"--data_dir .* is not a directory"):
        resolve_pattern(tmp_path / "nope", None, ["en"])


def test_lines_split_on_newlines_only(tmp_path: Path) -> None:
    """U+2028 and U+0085 occur inside real sentences; `splitlines` would cut there and shift every
    later line of that language against the others."""
    (tmp_path / "en.txt").write_bytes("a\u2028b\r\nc\x85d\ne\n".encode())
    (tmp_path / "fr.txt").write_text("x\ny\nz\n", encoding="utf-8")
    got = read_language_files(tmp_path, "{lang}.txt", ["en", "fr"])
    assert got == {"en": ["a\u2028b", "c\x85d", "e"], "fr": ["x", "y", "z"]}
    assert read_language_files(tmp_path, "{lang}.txt", ["en", "fr"], max_samples=2)["fr"] == ["x", "y"]


def test_bad_files_are_one_line(tmp_path: Path) -> None:
    write_files(tmp_path, "{lang}.txt", {"en": EN, "fr": FR[:-1], "de": []})
    cases = [
        (["en", "cs"], r"no file for language 'cs': .*cs.txt' does not exist"),
        (["en", "fr"], r"not line-aligned: en.txt has 6 lines but fr.txt has 5"),
        (["en", "de"], r"de.txt' \(de\) has no lines"),
    ]
    for langs, message in cases:
        with pytest.raises(EvaluateError, match=message) as err:
            read_language_files(tmp_path, "{lang}.txt", langs)
        assert "\n" not in str(err.value)


def test_codes_match_across_m2m100_and_flores200() -> None:
    """One language under M2M100's and FLORES-200's codes, related through pycountry's ISO 639
    and babel's CLDR tables (issue 36: `eng_Latn.devtest` was unreadable for an `en` model)."""
    from trainer.tokenizer.lang_codes import CodeKey, code_key, matching_codes

    flores = ["eng_Latn", "deu_Latn", "zho_Hans", "zho_Hant", "yue_Hant", "arb_Arab", "ary_Arab",
              "pes_Arab", "prs_Arab", "kor_Hang", "srp_Cyrl", "tgl_Latn", "zsm_Latn", "ces_Latn"]  # fmt: skip
    m2m100 = {"en": "eng_Latn", "de": "deu_Latn", "zh": "zho_Hans", "ar": "arb_Arab", "fa": "pes_Arab",
              "ko": "kor_Hang", "sr": "srp_Cyrl", "tl": "tgl_Latn", "ms": "zsm_Latn", "cs": "ces_Latn"}  # fmt: skip
    for code, flores_code in m2m100.items():
        assert matching_codes(code, flores) == [flores_code], code
        assert matching_codes(flores_code, list(m2m100)) == [code], flores_code  # and back
    assert matching_codes("zho_Hant", ["zh", "en"]) == ["zh"]  # the only Chinese tag
    assert matching_codes("en", ["en", "eng_Latn"]) == ["en"]  # the code itself first
    assert matching_codes("ps", flores + ["pbt_Arab"]) == []  # no table relates ps and pbt
    assert code_key("prs_Arab") == CodeKey("fa", "Arab", True)  # CLDR: prs -> fa_AF, a variant
    assert code_key("pes_Arab") == code_key("fa") == CodeKey("fa", "Arab", False)


def test_flores200_codes_name_the_files_of_an_m2m100_model_and_back(tmp_path: Path) -> None:
    flores = write_files(tmp_path / "flores", "devtest/{lang}.devtest", {"eng_Latn": EN, "fra_Latn": FR})
    assert resolve_pattern(flores, None, ["en"]) == "devtest/{lang}.devtest"
    assert read_language_files(flores, "devtest/{lang}.devtest", ["en", "fr"]) == {"en": EN, "fr": FR}
    plain = write_files(tmp_path / "plain", "{lang}.txt", {"en": EN, "fr": FR})
    assert read_language_files(plain, "{lang}.txt", ["eng_Latn", "fr"]) == {"eng_Latn": EN, "fr": FR}
    twice = write_files(tmp_path / "twice", "{lang}.txt", {"zho_Hans": EN, "cmn_Hans": EN})
    with pytest.raises(
        EvaluateError, match=r"'zh': several files could be its file \(cmn_Hans.txt, zho_Hans.txt\)"
    ):
        read_language_files(twice, "{lang}.txt", ["zh"])


# ----------------------------------------------------------------------------- table


def test_averages_by_english_group_and_the_markdown_table() -> None:
    assert groups_of("de", "en") == ["into English", "all"]
    assert groups_of("eng_Latn", "fra_Latn") == ["out of English", "all"]
    assert groups_of("de", "fr") == ["non-English", "all"]
    rows = {
        "en-de": {"sentences": 2, "bleu": 10.0, "chrf": 30.0},
        "de-en": {"sentences": 2, "bleu": 20.0, "chrf": 40.0},
        "de-fr": {"sentences": 2, "bleu": 1.0, "chrf": 5.0},
        "fr-de": {"sentences": 2, "bleu": 3.0, "chrf": 7.0},
    }
    assert averages(rows, ["bleu", "chrf"]) == {
        "into English": {"directions": 1, "bleu": 20.0, "chrf": 40.0},
        "out of English": {"directions": 1, "bleu": 10.0, "chrf": 30.0},
        "non-English": {"directions": 2, "bleu": 2.0, "chrf": 6.0},
        "all": {"directions": 4, "bleu": 8.5, "chrf": 20.5},
    }
    assert "into English" not in averages({"de-fr": rows["de-fr"]}, ["bleu"])  # empty groups left out
    md = to_markdown(build_result({"de-en": rows["de-en"]}, ["bleu", "chrf"], {}))
    assert md == (
        "| direction | sentences | BLEU | chrF |\n"
        "|---|---:|---:|---:|\n"
        "| de-en | 2 | 20.00 | 40.00 |\n"
        "\n"
        "| average | directions | BLEU | chrF |\n"
        "|---|---:|---:|---:|\n"
        "| into English | 1 | 20.00 | 40.00 |\n"
        "| all | 1 | 20.00 | 40.00 |\n"
    )


# ----------------------------------------------------------------------------- the command

FLAGS = ["--num_beams", "2", "--max_length", "8", "--batch_size", "4", "--disable_tqdm", "true"]


def test_evaluate_writes_the_table_json_and_predictions(
    model_dir: Path, flores: Path, tmp_path: Path, empty_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from models.generate import SearchSettings
    from trainer.eval.decode import translate
    from trainer.eval.hf_translate import load_model
    from trainer.tokenizer.vocab import Tokenizer

    out, stdout = tmp_path / "out", io.StringIO()
    argv = ["--model", str(model_dir), "--data_dir", str(flores), "--languages", "en", "fr",
            "--output_dir", str(out), *FLAGS]  # fmt: skip
    assert main(argv, stdout) == 0
    err = capsys.readouterr().err
    assert "2 directions x 6 sentences on one process, cpu" in err
    assert f"spBLEU not scored: sacreBLEU's flores200 SentencePiece model is not at {empty_cache}" in err
    result = json.loads((out / "scores.json").read_text())
    assert stdout.getvalue() == (out / "scores.md").read_text() == to_markdown(result)
    assert result["metrics"] == ["bleu", "chrf", "chrf++"]
    assert list(result["directions"]) == ["en-fr", "fr-en"]
    assert list(result["averages"]) == ["into English", "out of English", "all"]
    assert result["data"] == str(flores / "devtest/{lang}.devtest")
    # The scores are sacreBLEU's on the hypotheses written beside them, which are the translations.
    hyps = (out / "predictions_en-fr.txt").read_text().split("\n")[:-1]
    tok, model = Tokenizer.load(model_dir), load_model(model_dir, torch.device("cpu"))
    want = translate(model, tok, EN, "en", "fr", SearchSettings(num_beams=2, max_length=8), 4)
    assert hyps == [h.strip() for h in want]
    row = result["directions"]["en-fr"]
    assert row["sentences"] == 6
    assert row["chrf++"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [FR], word_order=2).score)
    assert row["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [FR]).score)
    assert result["averages"]["all"]["chrf"] == pytest.approx(
        (row["chrf"] + result["directions"]["fr-en"]["chrf"]) / 2
    )


def test_evaluate_scores_spbleu_where_its_model_is(
    model_dir: Path, flores: Path, empty_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.unit.test_metrics import place_spm_model

    place_spm_model(empty_cache, (EN + FR) * 10)
    stdout = io.StringIO()
    argv = ["--model", str(model_dir), "--data_dir", str(flores), "--directions", "fr-en", *FLAGS]
    assert main(argv, stdout) == 0
    assert stdout.getvalue().startswith("| direction | sentences | BLEU | chrF | chrF++ | spBLEU |\n")
    assert "spBLEU not scored" not in capsys.readouterr().err
    assert main([*argv, "--spbleu", "false"], io.StringIO()) == 0  # switched off: no column, no note
    assert "spBLEU" not in capsys.readouterr().err


def test_evaluate_takes_flores200_codes_for_an_m2m100_model(
    model_dir: Path, tmp_path: Path, empty_cache: Path
) -> None:
    """Issue 36: FLORES-200's `eng_Latn.devtest` for a model whose tags are `__en__`: `--languages
    en fr` reads it, and `--languages eng_Latn fra_Latn` decodes with `__en__` / `__fr__`; both give
    the table (under the codes asked) and hypotheses of files named by the model's codes."""
    flores = write_files(tmp_path / "flores", "devtest/{lang}.devtest", {"eng_Latn": EN, "fra_Latn": FR})
    plain = write_files(tmp_path / "plain", "{lang}.txt", {"en": EN, "fr": FR})
    runs = {
        "plain": ["--data_dir", str(plain), "--file_pattern", "{lang}.txt", "--languages", "en", "fr"],
        "m2m100 codes": ["--data_dir", str(flores), "--languages", "en", "fr"],
        "flores codes": ["--data_dir", str(flores), "--languages", "eng_Latn", "fra_Latn"],
    }
    got = {}
    for name, flags in runs.items():
        out = tmp_path / name.replace(" ", "-")
        assert main(["--model", str(model_dir), *flags, "--output_dir", str(out), *FLAGS], io.StringIO()) == 0
        result = json.loads((out / "scores.json").read_text())
        got[name] = (result["directions"], sorted(p.read_text() for p in out.glob("predictions_*.txt")))
    assert got["m2m100 codes"] == got["plain"]
    assert list(got["flores codes"][0]) == ["eng_Latn-fra_Latn", "fra_Latn-eng_Latn"]
    assert list(got["flores codes"][0].values()) == list(got["plain"][0].values())
    assert got["flores codes"][1] == got["plain"][1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--languages", "en", "fr", "de"], r"no file for language 'de': .*devtest/de.devtest' does not exist"),
        (["--directions", "en-fr", "--file_pattern", "{lang}.txt"], r"misaligned|not line-aligned: en.txt has 6"),
        (["--directions", "en_fr"], r"'en_fr' is not a direction"),
        (["--directions", "en-cs", "--file_pattern", "{lang}.txt"], r"has no tag __cs__; it has \['__en__', '__fr__'\]"),
        (["--directions", "en-fr", "--spbleu", "true"], r"--spbleu needs sacreBLEU's flores200 SentencePiece model at .*flores200sacrebleuspm.* fetch https://tinyurl.com/flores200sacrebleuspm"),
        (["--directions", "en-fr", "--max_samples", "0"], r"--max_samples 0 must be >= 1"),
        (["--directions", "en-fr", "--tensor_parallel_size", "2"], r"tensor_parallel_size=2 does not divide 1 rank"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_before_any_weight_is_read(
    model_dir: Path,
    flores: Path,
    empty_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    import trainer.eval.hf_translate

    write_files(flores, "{lang}.txt", {"en": EN, "fr": FR[:-1], "cs": EN})

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights read before the input was checked")

    monkeypatch.setattr(trainer.eval.hf_translate, "load_model", no_load)
    assert main(["--model", str(model_dir), "--data_dir", str(flores), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainer.evaluate: error: ") and "\n" not in err, err
    assert __import__("re").search(message, err), err


def test_bad_model_is_one_line(tmp_path: Path, flores: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert (
        main(["--model", str(tmp_path / "empty"), "--data_dir", str(flores), "--languages", "en", "fr"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "is neither an exported Hugging Face directory (config.json) nor a training checkpoint" in err
    assert "\n" not in err


def test_a_checkpoint_in_one_process_scores_as_its_hf_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A training checkpoint goes through the mesh path (one rank, `pipeline_generate`, DCP load);
    the same weights written as an HF directory (same ids) through `models.generate`: one table."""
    import torch.distributed as dist

    from models.hf_save import save_hf_model
    from tests.unit.test_export_errors import TEXTS, write_run
    from trainer.checkpoint.hf_export import load_full_state, read_model_config
    from trainer.tokenizer.vocab import train_tokenizer

    tok = train_tokenizer(TEXTS, ["de", "en"], 80)
    run = write_run(tmp_path / "run", tok)
    ckpt = run / "checkpoint-3"
    hf = tmp_path / "hf"
    config = read_model_config(ckpt)
    save_hf_model(load_full_state(ckpt, config), config, hf)
    tok.save_pretrained(hf, model_max_length=config.max_position_embeddings)
    # A blank line (issue 36): an empty hypothesis on both paths, not a made-up sentence.
    data = write_files(
        tmp_path / "data", "{lang}.txt", {"en": [*TEXTS[3::4][:5], ""], "de": [*TEXTS[1::4][:5], ""]}
    )
    common = ["--data_dir", str(data), "--file_pattern", "{lang}.txt", "--languages", "en", "de", *FLAGS]
    tables = {}
    for name, model in (("checkpoint", ckpt), ("hf", hf)):
        out = tmp_path / f"out-{name}"
        assert main(["--model", str(model), *common, "--output_dir", str(out)], io.StringIO()) == 0
        tables[name] = json.loads((out / "scores.json").read_text())
        for d in ("en-de", "de-en"):
            tables[name][d] = (out / f"predictions_{d}.txt").read_text()
    assert not dist.is_initialized()  # the one-rank group it made is gone
    assert "(pp, dp, tp) = (1, 1, 1), cpu" in capsys.readouterr().err
    for key in ("directions", "averages", "en-de", "de-en"):
        assert tables["checkpoint"][key] == tables["hf"][key], key
    assert tables["checkpoint"]["en-de"].split("\n")[5] == "" and tables["checkpoint"]["en-de"].split("\n")[4]
