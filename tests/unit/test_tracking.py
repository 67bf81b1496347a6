"""Tracking: metrics.jsonl rows from the logging rank only; W&B offline without an API key."""

from __future__ import annotations

import json

import pytest

from trainer.run.tracking import Tracker


def test_disabled_tracker_writes_nothing(tmp_path) -> None:
    t = Tracker(str(tmp_path), enabled=False, report_to="wandb")
    t.log({"step": 1, "loss": 1.0})
    t.close()
    assert not (tmp_path / "metrics.jsonl").exists() and t.wandb is None


def test_metrics_jsonl_rows(tmp_path) -> None:
    t = Tracker(str(tmp_path), enabled=True, report_to="none", disable_tqdm=True)
    t.log({"step": 1, "loss": 2.5, "lr": 1e-3})
    t.log({"step": 2, "eval_loss": 2.0, "eval_bleu": 3.0})
    t.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 2.5, "lr": 1e-3}, {"step": 2, "eval_loss": 2.0, "eval_bleu": 3.0}]


def test_wandb_runs_offline_without_key(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key
    t = Tracker(
        str(tmp_path), enabled=True, report_to="wandb", run_name="t", config={"d_model": 8}, disable_tqdm=True
    )
    assert "runs offline" in capsys.readouterr().out
    t.log({"step": 1, "loss": 1.5})
    t.log_samples(1, [("en-de", "one", "eins", "eins")])
    t.close()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline W&B run directory"


def test_dashboard_keys_are_grouped_like_the_hf_trainer() -> None:
    from trainer.run.tracking import dashboard_key

    assert dashboard_key("loss") == "train/loss"
    assert dashboard_key("tokens_per_sec") == "train/tokens_per_sec"
    assert dashboard_key("eval_loss") == "eval/loss"
    assert dashboard_key("eval_bleu_en-de") == "eval/bleu_en-de"


def test_tensorboard_and_wandb_together(tmp_path, monkeypatch) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "disabled")
    t = Tracker(str(tmp_path), enabled=True, report_to=["wandb", "tensorboard"], disable_tqdm=True)
    assert t.wandb is not None and t.tensorboard is not None
    t.log({"step": 1, "loss": 2.5, "lr": 1e-3})
    t.log({"step": 2, "loss": 2.0, "eval_bleu": 3.0})
    t.close()
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    assert {"train/loss", "train/lr", "eval/bleu"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (2, 2.0)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[1] == {"step": 2, "loss": 2.0, "eval_bleu": 3.0}  # the file keeps the flat names


def test_resumed_tracker_cuts_the_steps_after_the_checkpoint(tmp_path) -> None:
    """Was: a resumed run appended steps 3-4 again after the crashed run's 3-4 (each step twice)."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval_loss": 9.0}, *({"step": s, "loss": 9.0 - s} for s in range(1, 6))]
    rows.insert(3, {"step": 2, "eval_loss": 7.5})  # the eval row of the checkpoint's step stays
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')  # torn by the crash
    t = Tracker(str(tmp_path), enabled=True, disable_tqdm=True, initial_step=2)
    t.log({"step": 3, "loss": 5.5})
    t.close()
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert got == [*rows[:4], {"step": 3, "loss": 5.5}]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left
    Tracker(str(tmp_path), enabled=False, initial_step=1)  # only the logging rank touches the file
    assert len(path.read_text().splitlines()) == 5
    Tracker(str(tmp_path), enabled=True, disable_tqdm=True, initial_step=0)  # a fresh start: step 0 again
    assert path.read_text() == ""


def test_resumed_tensorboard_purges_the_steps_after_the_checkpoint(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = Tracker(str(tmp_path), enabled=True, report_to="tensorboard", disable_tqdm=True)
    for step in (1, 2, 3, 4):
        first.log({"step": step, "loss": 10.0 + step})
    first.close()
    resumed = Tracker(str(tmp_path), enabled=True, report_to="tensorboard", disable_tqdm=True, initial_step=2)
    for step in (3, 4):
        resumed.log({"step": step, "loss": float(step)})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 11.0),
        (2, 12.0),
        (3, 3.0),
        (4, 4.0),
    ]
