"""configs/run_translation_style.yaml trains as is (`python -m trainer.train --config ...`), end to end.

One process, tiny dims and few examples by flags; the rest is the config's: epochs,
eval/save strategy "epoch", the best checkpoint kept by save_total_limit and loaded at the
end, early stopping, do_predict writing predictions and scores. The metric and threshold
are chosen so every decision is known in advance whatever the losses are:

    greater_is_better=true on eval_loss   the loss falls, so the first evaluation (step 6)
                                          stays the best and is not the last checkpoint
    early_stopping_threshold=1e9          no later evaluation counts as an improvement:
                                          patience 1 stops at the second epoch (step 12)
    test_file = the validation file       predict_loss must then equal the best (step 6)
                                          eval_loss: the best weights were loaded

Regression: a run_translation config was rejected key by key; there was no best-checkpoint
selection, no early stopping and no test prediction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.served import Served

ROOT = Path(__file__).resolve().parents[2]
VALIDATION = "configs/data/en-de_sample/validation.jsonl"


def _train(served: Served, out: Path, *flags: str) -> str:
    """Run the config; returns what it printed on stderr (the log and the console lines)."""
    cmd = [served.python, "-m", "trainer.train", "--config", "configs/run_translation_style.yaml",
           "--output_dir", str(out), *flags]  # fmt: skip
    env = served.environ()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.dist
def test_run_translation_style_config_end_to_end(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "run"
    tiny = ["--d_model", "32", "--encoder_ffn_dim", "64", "--decoder_ffn_dim", "64", "--vocab_size", "300",
            "--max_train_samples", "192", "--per_device_train_batch_size", "32", "--num_train_epochs", "3",
            "--max_eval_samples", "16", "--generation_max_length", "12", "--logging_steps", "6"]  # fmt: skip
    decisions = ["--metric_for_best_model", "eval_loss", "--greater_is_better", "true",
                 "--early_stopping_patience", "1", "--early_stopping_threshold", "1e9",
                 "--save_total_limit", "1", "--test_file", VALIDATION, "--max_predict_samples", "16"]  # fmt: skip
    log = _train(served, out, *tiny, *decisions)

    summary = json.loads((out / "run_summary.json").read_text())
    evals = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").open()) if "eval_loss" in r}
    assert sorted(evals) == [0, 6, 12]  # before training, then each epoch until the early stop
    assert summary["steps"] == 12 and summary["early_stopped"] is True  # 18 steps without the stop
    best = str(out / "checkpoint-6")
    assert summary["best_model_checkpoint"] == best and summary["best_metric"] == evals[6]["eval_loss"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]
    state = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == best and state["best_model"]["patience_counter"] == 1
    assert summary["after"]["eval_loss"] == evals[6]["eval_loss"]  # the run ends with the best model

    results = json.loads((out / "predict_results.json").read_text())
    assert results["predict_loss"] == pytest.approx(evals[6]["eval_loss"], rel=1e-6)
    assert results["predict_loss"] != pytest.approx(evals[12]["eval_loss"], rel=1e-6)
    assert {"predict_bleu", "predict_chrf", "predict_bleu_en-de", "predict_chrf_en-de"} <= set(results)
    lines = (out / "predictions_en-de.txt").read_text().splitlines()
    assert len(lines) == results["predict_samples"]["en-de"] == 16  # max_predict_samples caps it
    assert (out / "generated_predictions.txt").read_text() == (out / "predictions_en-de.txt").read_text()
    # issue 36: the scores reached predict_results.json only; now a console line like the evaluations'
    line = f"predict (test) | loss {results['predict_loss']:.4f} | bleu {results['predict_bleu']:.2f} | chrF"
    assert line in log and f"| {out / 'predict_results.json'}" in log, log[-3000:]
    assert "data skipped: {" not in log  # issue 36: a line of zero counters (none were dropped here)

    # do_train=false: evaluate and predict a given checkpoint (here the best one), write no checkpoint
    only = tmp_path / "predict_only"
    _train(served, only, *tiny, *decisions, "--do_train", "false", "--resume_from_checkpoint", best)
    again = json.loads((only / "predict_results.json").read_text())
    assert again["predict_loss"] == pytest.approx(evals[6]["eval_loss"], rel=1e-6)
    assert (only / "predictions_en-de.txt").read_text() == (out / "predictions_en-de.txt").read_text()
    assert not list(only.glob("checkpoint-*"))
