"""load_best_model_at_end + metric_for_best_model + early_stopping_patience on 2 gloo ranks (pp=2).

The metrics of an evaluation live on the logging rank only (the last stage, rank 1 here); rank 0
(the first stage) writes trainer_state.json and must take the same decisions. The run trains with
the real trainer (`trainer.train.run`) and decisions known in advance whatever the losses are
(as in test_run_translation_style.py):

    eval/save every 2 steps, max_steps 8   without the early stop the run would reach step 8
    greater_is_better=true on eval_loss    the loss falls, so step 2 stays the best
    early_stopping_threshold=1e9           step 4 is no improvement: patience 1 stops there

Each rank snapshots its stage's weights at every save and after the best model is loaded:
the final weights must equal step 2's on both ranks (and differ from step 4's, the last
trained ones), both ranks must stop at step 4 and name the same best checkpoint, and the
group must finish (a rank that stopped alone would hang the other at its next collective).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def best_model_run(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train `cfg`; return the summary's decisions and which snapshot the final weights equal."""
    import datasets
    import torch

    import trainer.run.loop as train_module
    from trainer.config.parse import load_config_dict

    datasets.disable_progress_bars()
    snapshots: dict[str, dict[str, torch.Tensor]] = {}
    real_save, real_load = train_module.save, train_module.load_best_model

    def weights(ctx: Any) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in ctx.pm.model.state_dict().items()}

    def save(ctx: Any, step: int) -> None:
        snapshots[f"step-{step}"] = weights(ctx)
        real_save(ctx, step)

    def load_best_model(ctx: Any, step: int) -> None:
        real_load(ctx, step)
        snapshots["final"] = weights(ctx)

    train_module.save, train_module.load_best_model = save, load_best_model  # type: ignore[assignment]
    summary = train_module.run(load_config_dict(cfg))
    final = snapshots.pop("final")
    return {
        "steps": summary["steps"],
        "early_stopped": summary["early_stopped"],
        "best_model_checkpoint": summary["best_model_checkpoint"],
        "best_metric": summary["best_metric"],
        "final_equals": {
            name: all(torch.equal(final[k], snap[k]) for k in final) for name, snap in snapshots.items()
        },
        "num_tensors": len(final),
        "evals": {r["step"]: r["eval_loss"] for r in summary.get("history", []) if "eval_loss" in r},
    }


def test_best_checkpoint_and_early_stop_agree_across_pipeline_ranks(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = base_config(
        str(tmp_path),
        output_dir=str(out),
        language_pairs=["en-de"],
        builtin_size=300,
        pipeline_parallel_size=2,
        num_microbatches=2,
        per_device_train_batch_size=8,
        max_steps=8,
        do_eval=False,  # no evaluation before training: only the strategy's, at steps 2 and 4
        max_eval_samples=8,
        generation_max_length=8,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        early_stopping_patience=1,
        early_stopping_threshold=1e9,
    )
    r0, r1 = run_distributed(best_model_run, 2, args=(cfg,), timeout=150, collective_timeout=60)

    evals = r1["evals"]  # the logging rank (last stage) holds the history
    assert sorted(evals) == [2, 4], evals  # every 2 steps until the stop
    assert evals[4] < evals[2], f"precondition: the loss must fall for step 2 to stay best: {evals}"
    best = str(out / "checkpoint-2")
    for r in (r0, r1):
        assert r["steps"] == 4 and r["early_stopped"] is True, r  # 8 steps without the stop
        assert r["best_model_checkpoint"] == best and r["best_metric"] == evals[2], r
        # the stage's weights at the end are the best checkpoint's, not the last trained ones
        assert r["final_equals"] == {"step-2": True, "step-4": False}, r["final_equals"]
        assert r["num_tensors"] > 0
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())  # written by rank 0
    assert state["best_model_checkpoint"] == best and state["best_model"]["patience_counter"] == 1
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
