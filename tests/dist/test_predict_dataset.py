"""do_predict on a Hub-style dataset: `dataset_name` is a local `save_to_disk` directory whose
`test` split is translated per direction, as a `test_file` is (predictions_<d>.txt and scores).

Regression: do_predict needed a test_file; a dataset's own test split could not be used, and a
dataset without one would only have failed after training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.corpus_data import read_lines
from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

SIZES = {"train": 400, "validation": 16, "test": 12}


def predict_run(rank: int, world: int, cfg: dict[str, Any], no_test: dict[str, Any]) -> dict[str, Any]:
    """Train 2 steps and predict; then a dataset without a test split (must fail at set-up)."""
    import datasets

    from trainer.config.parse import load_config_dict
    from trainer.errors import DataError
    from trainer.run.loop import run

    datasets.disable_progress_bars()
    summary = run(load_config_dict(cfg))
    try:
        run(load_config_dict(no_test))
        error = "no error"
    except DataError as e:
        error = str(e)
    return {"predict": summary["predict"], "error": error}


def _save_dataset(path: Path, splits: list[str], text: Path) -> None:
    import datasets

    lines = {lang: [t.strip() for t in read_lines(text, "train", lang, sum(SIZES.values()))] for lang in ("en", "de")}
    rows = [{"translation": {"en": en, "de": de}} for en, de in zip(lines["en"], lines["de"])]
    parts, start = {}, 0
    for split, n in SIZES.items():
        parts[split], start = rows[start : start + n], start + n
    dd = datasets.DatasetDict({s: datasets.Dataset.from_list(parts[s]) for s in splits})
    dd.save_to_disk(str(path))


def test_do_predict_translates_the_test_split_of_a_saved_dataset(tmp_path: Path, multi30k: Path) -> None:
    _save_dataset(tmp_path / "saved", ["train", "validation", "test"], multi30k)
    _save_dataset(tmp_path / "no_test", ["train", "validation"], multi30k)
    out = tmp_path / "run"
    cfg = base_config(
        str(tmp_path), output_dir=str(out), dataset_name=str(tmp_path / "saved"),
        language_pairs=["en-de", "de-en"], vocab_size=400, max_steps=2, per_device_train_batch_size=8,
        do_predict=True, generation_max_length=8,
    )  # fmt: skip
    no_test = {**cfg, "dataset_name": str(tmp_path / "no_test"), "output_dir": str(tmp_path / "no_test_run")}
    [got] = run_distributed(predict_run, 1, args=(cfg, no_test), timeout=150)

    results = json.loads((out / "predict_results.json").read_text())
    assert results["predict_samples"] == {"en-de": 12, "de-en": 12}  # the test split (validation has 16)
    for d in ("en-de", "de-en"):
        assert {f"predict_bleu_{d}", f"predict_chrf_{d}", f"predict_chrf++_{d}"} <= set(results)
        assert len((out / f"predictions_{d}.txt").read_text().splitlines()) == 12
    assert {"predict_loss", "predict_bleu", "predict_chrf", "predict_chrf++"} <= set(results)
    assert not (out / "generated_predictions.txt").exists()  # run_translation's name: one direction only
    assert got["predict"]["predict_loss"] == results["predict_loss"]  # the run summary's copy
    assert "has no 'test' split for do_predict; it has ['train', 'validation']" in got["error"]
    assert not list((tmp_path / "no_test_run").glob("checkpoint-*"))  # refused before training
