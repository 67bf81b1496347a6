"""The field's metrics (issue 30): chrF++ beside BLEU and chrF, and spBLEU where its model is here.

chrF++ is sacreBLEU's chrF with word 1- and 2-grams (`word_order=2`), the score NLLB reports.
spBLEU is BLEU on sacreBLEU's `flores200` SentencePiece pieces; sacreBLEU downloads that
model on first use, which a run must never let it do: `eval_spbleu` is refused in one line
naming the path and the URL where the model is absent (the cache pointed at an empty
directory), and with a SentencePiece model trained here and placed where sacreBLEU looks,
the score is sacreBLEU's own `BLEU(tokenize="flores200")` with no download attempted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sacrebleu

from trainer.eval.decode import SAMPLES_KEY, DirectionTexts, score_directions
from trainer.eval.metrics import (
    SpBleuModelMissingError,
    check_spbleu_model,
    compute_metrics,
    spbleu_model_path,
)

REFS = [
    "the cat sat on the mat",
    "one hundred and sixty-two Somali shillings",
    "231 degrees Celsius",
    "a quick brown fox jumps over the lazy dog",
]
HYPS = [
    "the cat sat on a mat",
    "one hundred sixty two Somali shilling",
    "231 degree Celsius",
    "a fast brown fox jumped over lazy dogs",
]


@pytest.fixture
def sacrebleu_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sacreBLEU's cache pointed at an empty directory: `$SACREBLEU` for processes started from
    here, and the module's copy (read once at import) for this one; a download fails the test."""
    from sacrebleu.tokenizers import tokenizer_spm

    monkeypatch.setenv("SACREBLEU", str(tmp_path))
    monkeypatch.setattr(tokenizer_spm, "SACREBLEU_DIR", str(tmp_path))

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"sacreBLEU tried to download {args}")

    monkeypatch.setattr(tokenizer_spm, "download_file", no_download)
    return tmp_path


def test_chrf_plus_plus_is_sacrebleus_chrf_with_word_bigrams() -> None:
    got = compute_metrics(HYPS, REFS, "en")
    assert got["chrf++"] == sacrebleu.corpus_chrf(HYPS, [REFS], word_order=2).score
    assert got["chrf"] == sacrebleu.corpus_chrf(HYPS, [REFS]).score
    assert got["bleu"] == sacrebleu.corpus_bleu(HYPS, [REFS], tokenize="13a").score
    assert got["chrf++"] != got["chrf"]  # the word n-grams count
    assert set(got) == {"bleu", "chrf", "chrf++"}  # no spBLEU unless asked
    # Edge whitespace (which decoders differ in) does not count: trainer.evaluate strips it.
    assert compute_metrics([f" {h}  " for h in HYPS], REFS, "en") == got


def test_score_directions_reports_chrf_plus_plus_per_direction_and_averaged() -> None:
    sets = [
        DirectionTexts(("de", "en"), ["x"] * 4, REFS),
        DirectionTexts(("fr", "en"), ["y"] * 2, REFS[:2]),
    ]
    got = score_directions(lambda sources, src, tgt: HYPS[: len(sources)], sets)
    got.pop(SAMPLES_KEY)
    assert got["eval_chrf++_de-en"] == sacrebleu.corpus_chrf(HYPS, [REFS], word_order=2).score
    assert got["eval_chrf++_fr-en"] == sacrebleu.corpus_chrf(HYPS[:2], [REFS[:2]], word_order=2).score
    assert got["eval_chrf++"] == pytest.approx((got["eval_chrf++_de-en"] + got["eval_chrf++_fr-en"]) / 2)
    assert not any("spbleu" in k for k in got)


def test_chrf_plus_plus_is_a_metric_for_best_model_and_on_the_dashboard() -> None:
    from trainer.config.training_args import TrainingArguments
    from trainer.errors import ConfigError
    from trainer.run.strategies import check_metric_name
    from trainer.run.tracking import dashboard_key

    args = TrainingArguments(metric_for_best_model="chrf++", eval_steps=5)
    assert args.metric_for_best_model == "eval_chrf++" and args.greater_is_better is True
    check_metric_name("eval_chrf++", ["en-de"])
    check_metric_name("eval_chrf++_en-de", ["en-de"])
    check_metric_name("eval_spbleu_en-de", ["en-de"], spbleu=True)
    with pytest.raises(ConfigError, match=r"'eval_spbleu' is not an evaluation metric of this run"):
        check_metric_name("eval_spbleu", ["en-de"])  # only a run with eval_spbleu scores it
    assert dashboard_key("eval_chrf++_en-de") == "eval/chrf++_en-de"
    assert dashboard_key("eval_spbleu") == "eval/spbleu"


def test_chrf_plus_plus_reaches_tensorboard_and_wandb_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`+` is a valid character in W&B keys and TensorBoard tags: `eval/chrf++_en-de` arrives as is."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.run.tracking import Tracker

    logged: list[dict[str, float]] = []
    monkeypatch.setenv("WANDB_MODE", "disabled")
    t = Tracker(str(tmp_path), enabled=True, report_to=["tensorboard"], disable_tqdm=True)
    t.wandb = type(
        "FakeRun", (), {"log": lambda self, row, step: logged.append(row), "finish": lambda self: None}
    )()
    t.log({"step": 2, "eval_chrf++": 41.5, "eval_chrf++_en-de": 40.0})
    t.close()
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    assert {"eval/chrf++", "eval/chrf++_en-de"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("eval/chrf++_en-de")] == [(2, 40.0)]
    assert logged == [{"eval/chrf++": 41.5, "eval/chrf++_en-de": 40.0}]


def test_summary_prints_chrf_plus_plus_before_and_after(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.run.summary import print_summary

    s = {
        "mesh": {"pp": 1, "dp": 1, "tp": 1}, "partition": [8], "tokens_per_sec": 1.0, "wall_time_s": 1.0,
        "steps": 1, "output_dir": "out", "last_checkpoint": None,
        "before": {"eval_chrf++": 1.0}, "after": {"eval_chrf++": 2.5, "eval_spbleu": 3.25},
    }  # fmt: skip
    print_summary(s)
    out = capsys.readouterr().out
    assert "eval_chrf++          before      1.0   after      2.5" in out
    assert "eval_spbleu          before     None   after     3.25" in out


def test_spbleu_without_its_model_is_refused_in_one_line(sacrebleu_cache: Path) -> None:
    path = sacrebleu_cache / "models" / "flores200sacrebleuspm"
    assert spbleu_model_path() == path
    with pytest.raises(SpBleuModelMissingError) as err:
        check_spbleu_model("eval_spbleu")
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "https://tinyurl.com/flores200sacrebleuspm" in msg
    assert msg.startswith("eval_spbleu needs sacreBLEU's flores200 SentencePiece model at")
    with pytest.raises(SpBleuModelMissingError):  # scoring checks again rather than download
        compute_metrics(HYPS, REFS, "en", spbleu=True)
    assert not path.exists()


def test_eval_spbleu_is_refused_before_a_run_starts(sacrebleu_cache: Path) -> None:
    """validate_early: before anything is written or any collective runs."""
    from trainer.config.parse import load_config_dict
    from trainer.run.preflight import validate_early

    base = {"dataset_name": "builtin", "language_pairs": ["en-de", "de-en"]}
    with pytest.raises(SpBleuModelMissingError, match=r"^eval_spbleu needs .*flores200sacrebleuspm") as err:
        validate_early(load_config_dict({**base, "eval_spbleu": True}), world=1)
    assert "\n" not in str(err.value)
    assert validate_early(load_config_dict(base), world=1).dp == 1


def place_spm_model(cache: Path, texts: list[str]) -> Path:
    """A tiny SentencePiece model trained on `texts`, where sacreBLEU looks for flores200's."""
    import io

    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=proto, vocab_size=60, model_type="unigram",
        character_coverage=1.0, hard_vocab_limit=False, minloglevel=2, num_threads=1,
    )  # fmt: skip
    path = cache / "models" / "flores200sacrebleuspm"
    path.parent.mkdir(parents=True)
    path.write_bytes(proto.getvalue())
    return path


def test_spbleu_with_its_model_equals_sacrebleus_flores200_bleu(sacrebleu_cache: Path) -> None:
    import sentencepiece as spm

    path = place_spm_model(sacrebleu_cache, (REFS + HYPS) * 20)
    got = compute_metrics(HYPS, REFS, "en", spbleu=True)
    want = sacrebleu.BLEU(tokenize="flores200").corpus_score(HYPS, [REFS]).score
    assert got["spbleu"] == want
    # ... which is BLEU over the model's pieces (not 13a words): the file placed here was used.
    sp = spm.SentencePieceProcessor(model_file=str(path))
    pieces = [[" ".join(sp.encode(s, out_type=str)) for s in side] for side in (HYPS, REFS)]
    assert want == sacrebleu.corpus_bleu(pieces[0], [pieces[1]], tokenize="none").score
    assert want != got["bleu"]
    sets = [DirectionTexts(("de", "en"), ["x"] * 4, REFS)]
    keys = score_directions(lambda sources, src, tgt: HYPS, sets, spbleu=True)
    assert keys["eval_spbleu_de-en"] == keys["eval_spbleu"] == want


@pytest.mark.slow
def test_trainer_train_refuses_eval_spbleu_with_an_empty_sacrebleu_cache(tmp_path: Path) -> None:
    """The user's view: `$SACREBLEU` names an empty cache; `trainer.train --eval_spbleu true` stops in
    one line (exit 2) before it writes anything, naming where the file goes and where it comes from."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cache, out = tmp_path / "cache", tmp_path / "out"
    cache.mkdir()
    env = {**os.environ, "SACREBLEU": str(cache), "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "trainer.train", "--config", "configs/tiny.yaml", "--eval_spbleu", "true",
           "--output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert "\n" not in err, err
    assert (
        f"eval_spbleu needs sacreBLEU's flores200 SentencePiece model at {cache}/models/flores200sacrebleuspm"
        in err
    )
    assert "https://tinyurl.com/flores200sacrebleuspm" in err
    assert not out.exists() and not any(cache.iterdir())  # nothing written, nothing downloaded
