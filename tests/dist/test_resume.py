"""Honest resume through the real trainer (`trainer.train.run`) on one gloo rank.

The story: a run saves at step 2 and dies after logging steps 3-4 (its checkpoint-4 never
committed). Before, the resumed run appended steps 3-4 a second time to metrics.jsonl,
and a resume with other tokenizer settings retrained and overwrote tokenizer/,
config.yaml and model_config.json, then trained on silently different token ids (or,
with another vocab_size, failed only after overwriting them). Now metrics.jsonl holds
each step once, the run's files are read back untouched, and a mismatch is one error
that leaves every byte of output_dir as it was.

Issue 23: a resume drew the initial weights (or re-read the whole `model_name_or_path`)
only to overwrite them from the checkpoint, and failed when that directory was gone. A
fine-tune from an HF directory now resumes with the directory moved away: nothing drawn,
nothing read from it, the checkpoint loaded once, the same losses.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

MISMATCHES = {  # override -> what the error must say
    "spm_model_type": ("unigram", "spm_model_type='unigram' but the checkpoint's run has 'bpe' (tokenizer)"),
    "vocab_size": (800, "vocab_size=800 but the checkpoint's run has 1000 (tokenizer)"),
    "per_device_train_batch_size": (8, "global batch 8 = per_device_train_batch_size(8)"),
}


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def resume_story(rank: int, world: int, base: dict[str, Any]) -> dict[str, Any]:
    """Train 4 steps saving at 2, lose checkpoint-4, resume; then try each mismatch."""
    import datasets

    from trainer.errors import ConfigError
    from trainer.config.parse import load_config_dict
    from trainer.run.loop import run

    datasets.disable_progress_bars()
    out = Path(base["output_dir"])
    run(load_config_dict({**base, "save_steps": 2}))
    shutil.rmtree(out / "checkpoint-4")  # the crash: steps 3-4 were logged, their checkpoint never committed
    (out / "run_summary.json").unlink()
    run_files = ("config.yaml", "model_config.json", "tokenizer")
    before = {k: v for k, v in _hashes(out).items() if k.startswith(run_files)}
    resumed = run(load_config_dict({**base, "resume_from_checkpoint": "latest", "dist_timeout_s": 300}))
    after = {k: v for k, v in _hashes(out).items() if k.startswith(run_files)}
    errors, unchanged = {}, {}
    for name, (value, _) in MISMATCHES.items():
        snapshot = _hashes(out)
        try:
            run(load_config_dict({**base, "resume_from_checkpoint": "latest", name: value}))
            errors[name] = "no error"
        except ConfigError as e:
            errors[name] = str(e)
        unchanged[name] = _hashes(out) == snapshot
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "run_summary.json").read_text())  # the resumed run's
    return {
        **resume_without_pretrained_dir(base, out),
        "steps": [r["step"] for r in rows],
        "window_shares": [{k: v for k, v in r.items() if k.startswith("share/")} for r in rows if "loss" in r],
        "run_examples": {name: v["examples"] for name, v in summary["direction_shares"].items()},
        "resumed_history": [r["step"] for r in resumed["history"]],
        "run_files_kept": before == after and len(before) > 3,
        "errors": errors,
        "unchanged": unchanged,
    }


def resume_without_pretrained_dir(base: dict[str, Any], out: Path) -> dict[str, Any]:
    """Fine-tune the run's architecture from an HF directory (4 steps, saving at 2), lose
    checkpoint-4, move the directory away and resume: (the two runs' losses, how many
    initial-weight draws and HF reads each made)."""
    from models.config import ModelConfig
    from models.hf_save import save_hf_model
    from models.m2m100 import M2M100Translation
    from trainer.config.parse import load_config_dict
    from trainer.run.loop import run

    pretrained = out.parent / "pretrained"
    mc = ModelConfig.from_dict(json.loads((out / "model_config.json").read_text()))
    save_hf_model(dict(M2M100Translation(mc, seed=5).state_dict()), mc, pretrained)
    shutil.copytree(out / "tokenizer", pretrained, dirs_exist_ok=True)
    tuned = {**base, "model_name_or_path": str(pretrained), "output_dir": str(out.parent / "tuned"), "save_steps": 2}
    calls = {"draws": 0, "reads": 0}
    with pytest.MonkeyPatch.context() as mp:
        for owner, name, kind in ((M2M100Translation, "init_value", "draws"), (models_hf(), "read_hf_slices", "reads")):
            mp.setattr(owner, name, _counting(getattr(owner, name), calls, kind))
        whole = run(load_config_dict(tuned))
        fresh = dict(calls)
        shutil.rmtree(out.parent / "tuned" / "checkpoint-4")
        pretrained.rename(out.parent / "moved-away")
        calls.update(draws=0, reads=0)
        resumed = run(load_config_dict({**tuned, "resume_from_checkpoint": "latest"}))

    def losses(summary: dict[str, Any]) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in summary["history"] if "loss" in r}

    return {"tuned": losses(whole), "tuned_resumed": losses(resumed), "fresh_calls": fresh, "resume_calls": calls}


def models_hf() -> Any:
    import models.hf

    return models.hf


def _counting(fn: Any, calls: dict[str, int], kind: str) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[kind] += 1
        return fn(*args, **kwargs)

    return counted


def test_resume_cuts_metrics_reads_back_and_refuses_mismatches(tmp_path: Path) -> None:
    base = base_config(str(tmp_path), max_steps=4, builtin_size=300, per_device_train_batch_size=4)
    base["output_dir"] = str(tmp_path / "run")
    [got] = run_distributed(resume_story, 1, args=(base,), timeout=400)
    assert got["steps"] == [1, 2, 3, 4], got["steps"]  # was [1, 2, 3, 4, 3, 4]
    assert got["resumed_history"] == [3, 4]  # dist_timeout_s may change on resume
    assert got["run_files_kept"]
    # share/<direction> of each row is that step's sampled fraction (logging_steps 1, global batch 4):
    # summed over the rows, before and after the resume, they count the run's examples per direction
    directions = sorted(got["run_examples"])
    assert [sorted(k.split("/", 1)[1] for k in r) for r in got["window_shares"]] == [directions] * 4
    counted = {d: sum(r[f"share/{d}"] * 4 for r in got["window_shares"]) for d in directions}
    assert counted == pytest.approx(got["run_examples"]) and sum(counted.values()) == pytest.approx(16)
    for name, (_, message) in MISMATCHES.items():
        assert message in got["errors"][name], got["errors"][name]
        assert got["unchanged"][name], f"{name}: output_dir changed"
    # model_name_or_path moved away before the resume: nothing drawn or read, the same losses
    assert got["fresh_calls"]["reads"] > 0 and got["fresh_calls"]["draws"] == 0, got["fresh_calls"]
    assert got["resume_calls"] == {"draws": 0, "reads": 0}, got["resume_calls"]
    assert sorted(got["tuned_resumed"]) == [3, 4], got["tuned_resumed"]
    for step, loss in got["tuned_resumed"].items():
        assert loss == got["tuned"][step], (step, loss, got["tuned"])
