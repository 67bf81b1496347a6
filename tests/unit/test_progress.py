"""Following a run (issue 30): the console lines of the rows, progress bars and lines, curves.png.

Before, with `disable_tqdm` (configs/tiny.yaml) nothing per step reached the console, the
evaluation metrics appeared only in the final summary, and no loss or BLEU curve was drawn.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from trainer.progress import PROGRESS_LOGGER, Progress, format_duration
from trainer.run import tracking
from trainer.run.console import eval_line, predict_line, train_line
from trainer.run.curves import read_rows, render_curves
from trainer.run.tracking import Tracker

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TRAIN = {"step": 4, "loss": 6.12341, "lr": 1e-3, "grad_norm": 1.5, "tokens_per_sec": 10320.4,
         "step_time_s": 0.214, "epoch": 0, "skipped_steps": 0, "bubble_fraction": 0.0}  # fmt: skip
EVAL = {"step": 4, "eval_loss": 6.2, "eval_loss_en-de": 6.1, "eval_bleu": 0.84, "eval_chrf": 12.31,
        "eval_bleu_en-de": 0.5, "eval_chrf_en-de": 12.0, "eval_bleu_de-en": 1.18, "eval_chrf_de-en": 12.6}  # fmt: skip


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]


def test_train_line_prints_the_known_keys_the_row_has() -> None:
    """`data_time_s` (added to the rows by the data loader) shows up once a row carries it."""
    line = train_line(TRAIN, max_steps=10, eta_s=65)
    assert line == (
        "step 4/10 | loss 6.1234 | lr 1.00e-03 | grad_norm 1.5 | tokens/s 10320 | step 0.214 s | eta 0:01:05"
    )  # no bubble for one stage, no `skipped` while none was skipped
    line = train_line({**TRAIN, "data_time_s": 0.0021, "bubble_fraction_theory": 0.2}, 10, None)
    assert "| data 0.002 s" in line and "| bubble 0.0%" in line and "eta" not in line
    assert train_line({"step": 1, "loss": 2.0}, 3, None) == "step 1/3 | loss 2.0000"


def test_eval_line_is_compact_and_shortens_many_directions() -> None:
    assert eval_line(EVAL) == (
        "eval step 4 | loss 6.2000 | bleu 0.84 | chrF 12.31 | bleu en-de 0.5 de-en 1.2"
    )
    assert "| chrF++ 10.50 |" in eval_line({**EVAL, "eval_chrf++": 10.5})
    many = {"step": 9, "eval_bleu": 5.0, **{f"eval_bleu_l{i}-en": float(i) for i in range(20)}}
    assert eval_line(many).endswith("bleu min 0.0 (l0-en) median 9.5 max 19.0 (l19-en) over 20 directions")


def test_predict_line_is_the_eval_line_of_the_test_scores() -> None:
    """Issue 36: do_predict's scores reached predict_results.json only, never the console; the run
    now prints this line (tests/dist/test_run_translation_style.py sees it in a run's log)."""
    result = {k.replace("eval_", "predict_", 1): v for k, v in EVAL.items() if k != "step"}
    assert predict_line({**result, "predict_samples": {"en-de": 12}, "skipped": {}}) == (
        "predict (test) | loss 6.2000 | bleu 0.84 | chrF 12.31 | bleu en-de 0.5 de-en 1.2"
    )


def test_tracker_without_bar_logs_every_training_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: with disable_tqdm, a SLURM log showed nothing from the first step to the summary."""
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    t = Tracker(str(tmp_path), enabled=True, disable_tqdm=True, max_steps=10)
    for step in (1, 2):
        t.advance()
        t.log({**TRAIN, "step": step})
    t.close()
    lines = _messages(caplog)
    assert [line.split(" | ")[0] for line in lines] == ["step 1/10", "step 2/10"]
    assert all(re.search(r"\| eta \d+:\d\d:\d\d$", line) for line in lines), lines


def test_tracker_logs_each_evaluation_when_it_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: evaluation metrics appeared only in the final summary."""
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    for disable_tqdm in (True, False):  # with the bar on too (written under it)
        t = Tracker(str(tmp_path), enabled=True, disable_tqdm=disable_tqdm, max_steps=10)
        t.log(EVAL)
        t.close()
    assert _messages(caplog) == [eval_line(EVAL)] * 2
    caplog.clear()
    Tracker(str(tmp_path), enabled=False).log(EVAL)  # other ranks say nothing
    assert _messages(caplog) == []


def _check_png(path: Path) -> tuple[int, int]:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width = matplotlib.image.imread(str(path)).shape[:2]
    return width, height


def test_curves_from_rows_with_missing_keys(tmp_path: Path) -> None:
    """No evaluation yet, a single row, chrF++ where present, per-direction curves."""
    png = tmp_path / "curves.png"
    assert render_curves([TRAIN], png, "one row") == ["loss", "BLEU", "chrF", "learning rate"]
    assert _check_png(png) == (990, 630)
    rows = [{**TRAIN, "step": s, "loss": 7.0 - s / 10} for s in range(1, 30)]
    rows += [{**EVAL, "step": s, "eval_chrf++": 11.0 + s, "eval_chrf++_en-de": 11.0} for s in (0, 10, 20)]
    assert render_curves(rows, png, "run") == ["loss", "BLEU", "chrF++", "learning rate"]
    assert _check_png(png) == (990, 630)


def test_tracker_draws_curves_from_metrics_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')  # a torn line
    t = Tracker(str(tmp_path), enabled=True, disable_tqdm=True, initial_step=1)  # keeps step 1
    sent: list[tuple[int, str, str]] = []
    t.log_image = lambda step, key, path: sent.append((step, key, path))  # type: ignore[method-assign]
    t.log({**TRAIN, "step": 2})
    assert t.draw_curves(2) is None  # an evaluation within CURVES_EVERY_S of the start: not drawn
    t.log({**EVAL, "step": 2})
    assert t.draw_curves(2, final=True) == str(tmp_path / "curves.png")  # the end: always
    assert sent == [(2, "curves", str(tmp_path / "curves.png"))]  # W&B: train/curves
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1, 2, 2]
    assert t.draw_curves(2, final=True) is None  # no new row: not redrawn
    t.log({**EVAL, "step": 3})
    assert t.draw_curves(3) is None  # within CURVES_EVERY_S of the last drawing
    monkeypatch.setattr(tracking, "CURVES_EVERY_S", 0.0)
    assert t.draw_curves(3) == str(tmp_path / "curves.png")  # past it
    t.close()
    _check_png(tmp_path / "curves.png")
    assert Tracker(str(tmp_path / "other"), enabled=False).draw_curves(1) is None
    (tmp_path / "off").mkdir()
    off = Tracker(str(tmp_path / "off"), enabled=True, disable_tqdm=True, plots=False)  # `plots: false`
    off.log({**TRAIN, "step": 1})
    assert off.draw_curves(1, final=True) is None and not (tmp_path / "off" / "curves.png").exists()
    off.close()


def test_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(4, "export", "B") as bar:
        bar.update(2, shard="1/2")
        bar.update(2, shard="2/2")
    err = capsys.readouterr()
    assert err.out == "" and "export: 100%" in err.err and "shard=2/2" in err.err


def test_progress_lines_when_bars_are_off(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """disable_tqdm (bar=False; TQDM_DISABLE=1 alike): a line with count, ETA and postfix every `every_s`."""
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    with Progress(4, "eval translate step 5", "sent", bar=False, every_s=0.0) as bar:
        bar.update(1, direction="en-de")
        bar.update(3, direction="de-en")
    lines = _messages(caplog)
    assert re.fullmatch(
        r"eval translate step 5: 1/4 sent \(25%\), 0:00:00 elapsed, eta 0:00:00, direction en-de",
        lines[0],
    ), lines
    assert lines[1].startswith("eval translate step 5: 4/4 sent (100%)") and len(lines) == 3
    caplog.clear()
    with Progress(10, "quiet", bar=False, every_s=60) as bar:  # short work: no line at all
        bar.update(10)
    with Progress(10, "off", enabled=False) as bar:
        bar.update(10)
    assert _messages(caplog) == [] and capsys.readouterr().err == ""
    assert format_duration(3725.4) == "1:02:05"
