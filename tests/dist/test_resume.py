"""Honest resume through the real trainer (`trainer.train.run`) on one gloo rank.

The story: a run saves at step 2 and dies after logging steps 3-4 (its checkpoint-4 never
committed). Before, the resumed run appended steps 3-4 a second time to metrics.jsonl,
and a resume with other tokenizer settings retrained and overwrote tokenizer/,
config.yaml and model_config.json, then trained on silently different token ids (or,
with another vocab_size, failed only after overwriting them). Now metrics.jsonl holds
each step once, the run's files are read back untouched, and a mismatch is one error
that leaves every byte of output_dir as it was.
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
        "steps": [r["step"] for r in rows],
        "window_shares": [{k: v for k, v in r.items() if k.startswith("share/")} for r in rows if "loss" in r],
        "run_examples": {name: v["examples"] for name, v in summary["direction_shares"].items()},
        "resumed_history": [r["step"] for r in resumed["history"]],
        "run_files_kept": before == after and len(before) > 3,
        "errors": errors,
        "unchanged": unchanged,
    }


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
