"""fp16 with dynamic loss scaling through the real trainer on (pp, tp) = (2, 2) and (pp, dp) =
(2, 2) FSDP gloo meshes, and FSDP's fp16 gradients against fp32 below the trainer.

The story (issue 20): `fp16: true` was refused because nothing scaled the loss, and a
per-process `GradScaler` cannot work in a pipeline: an overflow seen by one pp or tp rank
only would skip the step there and apply it elsewhere, and the replicas would drift apart.
Here the found-inf flag rides in the step guard's one all-reduce, so every rank takes the
same decision and holds the same scale.

One spawned 4-rank group trains twice: straight through 12 steps (saving at 4, 8, 12) and
resumed from checkpoint-4 into a fresh output_dir. The first steps overflow by themselves
(`fp16_initial_scale` 2**20 is above what these gradients tolerate in fp16) and back off;
at step 5 one gradient element of pp rank 0, tp rank 1 only is made inf before the
unscale (as a local backward overflow would be). A second group, pp=2 x dp=2 under FSDP,
does the same with the inf in one dp shard, evaluation on (BLEU decoded in fp16 on the mesh)
and resumed, then trains the same mesh in bf16 with evaluation and resumes it. Every rank
records, after each step, whether it skipped, why, its scale and growth tracker, and its own
(local) found-inf flag.
A last 2-rank group checks that FSDP's sharded fp16 gradients unscale to the fp32 ones.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config, mesh_overrides

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
INJECT_STEP = 5  # a step that does not overflow by itself
INITIAL, INTERVAL = 2.0**20, 4
SMALL_DATA = {"builtin_size": 300, "max_train_samples": 128}  # set-up dominates a 12-step run


def fp16_story(
    rank: int, world: int, base: dict[str, Any], inject_at: tuple[int, int, int], resume: bool
) -> dict[str, Any]:
    """Straight run (and a resumed one); per rank: step records, local flags, host reads of step 4,
    history. At INJECT_STEP the rank at mesh coordinates `inject_at` (pp, dp, tp) gets one inf."""
    import logging

    import datasets

    from parallel.dp.fsdp import local
    from parallel.loss_scale import DynamicLossScale
    from parallel.parallelize import ParallelModel
    from tests.dist.guard_workers import step_with_device_reads
    from trainer.config.parse import load_config_dict
    from trainer.run import loop

    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING)
    records: list[tuple[int, bool, bool, float, int]] = []
    local_found: dict[int, Any] = {}  # step -> this rank's flag before the agreement (read after the run)
    reads: list[int] = []
    current = {"step": 0}
    original_step, original_pm_step = loop.train_step, ParallelModel.train_step
    original_unscale = DynamicLossScale.unscale_

    def recording_unscale(self: Any, grads: Any) -> Any:
        found = original_unscale(self, grads)
        local_found[current["step"]] = found.clone()
        return found

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        step, scaler = args[6], kwargs["scaler"]
        current["step"] = step
        if step != 4:
            st = original_step(*args, **kwargs)
        else:  # the device reads of one whole fp16 step: the guard's, and nothing else
            st, n_reads = step_with_device_reads(original_step, *args, **kwargs)
            reads.append(n_reads)
        records.append((step, st.skipped, st.overflow, float(scaler.scale), int(scaler.growth_tracker)))
        return st

    def injecting_pm_step(pm: Any, *args: Any, **kwargs: Any) -> Any:
        results = original_pm_step(pm, *args, **kwargs)
        if (
            current["step"] == INJECT_STEP
            and (pm.mesh.pp_rank, pm.mesh.dp_rank, pm.mesh.tp_rank) == inject_at
        ):
            p = next(q for q in pm.model.parameters() if q.grad is not None)
            local(p.grad).view(-1)[0] = float("inf")  # scaled grads (FSDP: the dp shard), before the unscale
        return results

    loop.train_step = recording_step  # type: ignore[assignment]
    ParallelModel.train_step = injecting_pm_step  # type: ignore[method-assign]
    DynamicLossScale.unscale_ = recording_unscale  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        straight = loop.run(load_config_dict({**base, "output_dir": f"{base['output_dir']}-straight"}))
        out["straight"] = (list(records), straight.get("history", []), straight.get("overflow_steps"))
        out["reads"] = list(reads)
        out["local_found"] = {step: float(flag) for step, flag in local_found.items()}
        records.clear()
        if not resume:
            return out
        ckpt = Path(f"{base['output_dir']}-straight") / "checkpoint-4"
        resumed_cfg = {
            **base,
            "output_dir": f"{base['output_dir']}-resumed",
            "resume_from_checkpoint": str(ckpt),
        }
        resumed = loop.run(load_config_dict(resumed_cfg))
        out["resumed"] = (list(records), resumed.get("history", []), resumed.get("overflow_steps"))
    finally:
        loop.train_step = original_step  # type: ignore[assignment]
        ParallelModel.train_step = original_pm_step  # type: ignore[method-assign]
        DynamicLossScale.unscale_ = original_unscale  # type: ignore[method-assign]
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp16")


@pytest.fixture(scope="module")
def story(tmp: Path) -> list[dict[str, Any]]:
    base = {
        **base_config(str(tmp)),
        **mesh_overrides(pp=2, tp=2, m=2),
        **SMALL_DATA,
        "max_steps": 12,
        "save_steps": 4,
        "fp16": True,
        "fp16_initial_scale": INITIAL,
        "fp16_scale_growth_interval": INTERVAL,
    }
    return run_distributed(fp16_story, 4, args=(base, (0, 0, 1), True), timeout=500, collective_timeout=120)


def fp16_story_then_bf16(
    rank: int, world: int, base: dict[str, Any], inject_at: tuple[int, int, int], bf16_base: dict[str, Any]
) -> dict[str, Any]:
    """`fp16_story` (resumed too), then in the same group the bf16 run of `bf16_base` (evaluation
    on, resumed: `tests.dist.fsdp_workers.train_eval_resume`)."""
    from tests.dist.fsdp_workers import train_eval_resume

    out = fp16_story(rank, world, base, inject_at, True)
    out["bf16"] = train_eval_resume(rank, world, bf16_base, [{"bf16": True}])
    return out


@pytest.fixture(scope="module")
def dp_story(tmp: Path) -> list[dict[str, Any]]:
    """pp=2 x dp=2 with FSDP (fp16 gathered working weights), evaluation on: the inf lands in one
    dp shard of pp rank 0's gradients only (after the reduce-scatter); resumed from checkpoint-4.
    Then the same mesh with bf16 (issue 23: fsdp + bf16 with evaluation crashed before step 1)."""
    from tests.dist.test_fsdp import EVAL_ON

    eval_on = {k: v for k, v in EVAL_ON.items() if k not in ("max_steps", "save_steps")}
    base = {
        **base_config(str(tmp / "dp")),
        **mesh_overrides(pp=2, dp=2, m=2),
        **SMALL_DATA,
        **eval_on,
        "max_steps": 8,
        "save_steps": 4,
        "fp16": True,
        "fp16_initial_scale": INITIAL,
        "fp16_scale_growth_interval": INTERVAL,
    }
    bf16_base = {**base_config(str(tmp / "dp-bf16")), **mesh_overrides(pp=2, dp=2, m=2), **SMALL_DATA, **EVAL_ON}
    return run_distributed(
        fp16_story_then_bf16, 4, args=(base, (0, 1, 0), bf16_base), timeout=600, collective_timeout=120
    )


def _rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in history if "lr" in r]


def _check_agreement(story: list[dict[str, Any]], injected_rank: int) -> None:
    records = [r["straight"][0] for r in story]
    for rank, rec in enumerate(records[1:], start=1):
        assert rec == records[0], f"rank {rank} disagrees with rank 0:\n{rec}\n{records[0]}"
    steps = {
        step: (skipped, overflow, scale, tracker) for step, skipped, overflow, scale, tracker in records[0]
    }
    assert steps[1][:2] == (True, True), f"2**20 overflows at first: {steps}"
    assert all(skipped == overflow for skipped, overflow, _, _ in steps.values())  # no divergence skips
    # The whole trajectory follows the rule from the agreed flags: halve on overflow, double after
    # INTERVAL clean steps in a row.
    scale, tracker = INITIAL, 0
    for step in sorted(steps):
        if steps[step][1]:
            scale, tracker = scale / 2, 0
        else:
            tracker += 1
            if tracker == INTERVAL:
                scale, tracker = scale * 2, 0
        assert steps[step][2:] == (scale, tracker), f"step {step}: {steps}"
    # One rank's inf (its local flag alone is set) skips the step on every rank.
    local = [r["local_found"][INJECT_STEP] for r in story]
    assert local == [float(r == injected_rank) for r in range(len(story))], f"local flags: {local}"
    assert steps[INJECT_STEP][:2] == (True, True), f"step {INJECT_STEP}: {steps}"


def test_pp_tp_ranks_skip_the_same_steps_and_hold_the_same_scale(story) -> None:
    _check_agreement(story, injected_rank=1)  # (pp, dp, tp) = (0, 0, 1)
    steps = story[0]["straight"][0]
    assert any(b[3] > a[3] for a, b in zip(steps, steps[1:])), f"the scale never grew: {steps}"


def test_pp_dp_ranks_skip_the_same_steps_and_hold_the_same_scale(dp_story) -> None:
    _check_agreement(dp_story, injected_rank=1)  # (pp, dp, tp) = (0, 1, 0)
    rows = next(r["straight"][1] for r in dp_story if r["straight"][1])
    losses = [row["loss"] for row in _rows(rows)]
    assert losses[-1] < losses[0] - 0.1, f"fp16 + FSDP does not learn: {losses}"


def test_pp_dp_fsdp_fp16_and_bf16_evaluate_and_resume(dp_story) -> None:
    """pp=2 x dp=2 fsdp, evaluation on: fp16 decodes (eval_bleu before and after) and its resumed
    run continues the straight one, loss scale included; bf16 evaluates, trains and resumes."""
    from tests.dist.test_fsdp import check_trains_evaluates_and_resumes, eval_rows

    _check_resumed(dp_story)
    logger = next(r for r in dp_story if r["straight"][1])
    evals = eval_rows(logger["straight"][1])
    assert sorted(evals) == [0, 8] and all("eval_bleu" in r for r in evals.values()), evals
    assert eval_rows(logger["resumed"][1])[8]["eval_bleu"] == evals[8]["eval_bleu"]
    ((straight, resumed, _),) = logger["bf16"]
    check_trains_evaluates_and_resumes(straight, resumed, "pp=2 x dp=2 fsdp bf16")


def test_metrics_log_the_scale_and_the_overflow_count(story) -> None:
    logger = next(r for r in story if r["straight"][1])  # the last stage's tp=0 rank logs
    records, history, summary_overflows = logger["straight"]
    rows = _rows(history)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["loss_scale"] for r in rows] == [scale for _, _, _, scale, _ in records]
    overflowed = [step for step, _, overflow, _, _ in records if overflow]
    assert [r["overflow_steps"] for r in rows] == [sum(s <= r["step"] for s in overflowed) for r in rows]
    assert summary_overflows == len(overflowed) and all(r["skipped_steps"] == 0 for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows)  # an overflow step's loss is finite and logged
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2, f"fp16 training does not learn: {rows}"


def test_one_device_read_per_fp16_step(story) -> None:
    assert [r["reads"] for r in story] == [[1]] * 4  # the guard's (loss, norm, signal, overflow) read


def test_resumed_run_equals_the_straight_run_scale_included(story) -> None:
    _check_resumed(story)


def _check_resumed(story: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(story):
        straight, resumed = r["straight"][0], r["resumed"][0]
        assert resumed == [rec for rec in straight if rec[0] > 4], f"rank {rank}: {resumed} vs {straight}"
    logger = next(r for r in story if r["straight"][1])
    straight_rows = {row["step"]: row for row in _rows(logger["straight"][1])}
    for row in _rows(logger["resumed"][1]):
        ref = straight_rows[row["step"]]
        assert (row["loss"], row["loss_scale"], row["grad_norm"]) == (
            ref["loss"],
            ref["loss_scale"],
            ref["grad_norm"],
        )


def test_checkpoint_holds_the_scale_and_growth_tracker(story, tmp: Path) -> None:
    import json

    at_4 = next(rec for rec in story[0]["straight"][0] if rec[0] == 4)
    state = json.loads((tmp / "run-straight" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["loss_scale"] == {"scale": at_4[3], "growth_tracker": at_4[4]}
    assert at_4[4] > 0, "the checkpoint should fall mid-interval, so the tracker's restore matters"


def fsdp_fp16_step(rank: int, world: int) -> tuple[float, float, float, bool]:
    """FSDP (dp=2) with fp16 working weights (its MixedPrecisionPolicy) and the loss scale, below
    the trainer: one step at S = 2**10 against the one-process fp32 step, then S = 2**40.
    Returns (worst relative first-step grad error, found-inf at 2**10, at 2**40, grads are DTensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    from parallel.loss_scale import DynamicLossScale
    from tests.dist.fsdp_workers import MAX_NORM, _rel, build, flushes_of, full, reference_run
    from tests.dist.pipeline_workers import random_batch

    _, ref_grads, _ = reference_run(1)
    pm = build(world, 1, 2, 1, "1f1b", 2, sharding="fsdp", autocast_dtype=torch.float16)
    batch = random_batch(pm.model.config, 8, seed=100)
    found = []
    for scale in (2.0**10, 2.0**40):
        scaler = DynamicLossScale(pm.device, init_scale=scale)
        pm.train_step(flushes_of(pm, batch, 2, 1), loss_scale=scaler.scale / batch.num_tokens())
        found.append(float(scaler.unscale_(p.grad for p in pm.params())))
        if scale == 2.0**10:
            pm.grads.clip_(MAX_NORM)
            grads = {k: full(pm, k, p.grad) for k, p in pm.named_params().items()}
            err = max(_rel(grads[k], ref_grads[k]) for k in grads)
            sharded = all(isinstance(p.grad, DTensor) for p in pm.params() if p.grad is not None)
        pm.model.zero_grad(set_to_none=True)
    return err, found[0], found[1], sharded


def test_fsdp_fp16_gradients_unscale_to_the_fp32_ones() -> None:
    for err, clean, huge, sharded in run_distributed(fsdp_fp16_step, 2, timeout=300):
        assert sharded, "FSDP gradients are DTensors: the unscale must reach their dp shards"
        assert (clean, huge) == (0.0, 1.0), f"found-inf at 2**10: {clean}, at 2**40: {huge}"
        assert err < 1e-2, f"fp16 + FSDP unscaled grads vs fp32: worst relative error {err:.3e}"
