"""`async_save: true` through the real trainer, on 2 gloo ranks (tp=2: DTensor shards staged too).

One spawned group runs the story in order (spawning and set-up dominate the cost):

1. a synchronous run of 6 steps saving every 2 is the reference;
2. the same run with async_save logs the same losses; checkpoint-2 (written in the
   background while step 3 updated the weights), -4 and -6 are committed and verify against
   their markers; resumed from checkpoint-2 (async, save_total_limit=1), steps 3-6 equal the
   reference's, and rotation (after each commit) left only the last checkpoint;
3. rank 1 alone hits a file-size limit (RLIMIT_FSIZE -> EFBIG, as in test_faults_checkpoint)
   while its thread writes checkpoint-1: the failure surfaces at the next wait (the save at
   step 2), both ranks raise the same CheckpointWriteError, and checkpoint-1 is gone, no
   marker left;
4. SIGTERM on rank 0 at step 3 (TRAINER_FAULT_INJECT=term) while checkpoint-2 is in flight:
   the run exits Preempted only after checkpoint-2 and checkpoint-3 are both committed;
5. with FSDP over dp=2 (DTensor parameters and moments sharded over dp), an async run and
   its resume from checkpoint-2 log the synchronous run's losses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config, mesh_overrides

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def async_story(rank: int, world: int, base: dict[str, Any]) -> dict[str, Any]:
    """The four cases above, in order; returns what each rank saw."""
    import resource

    import datasets
    import torch.distributed as dist

    from trainer.checkpoint.commit import COMMIT_MARKER, verify_checkpoint
    from trainer.checkpoint.commit import list_checkpoints
    from trainer.config.parse import load_config_dict
    from trainer.run.guard import Preempted
    from trainer.run.loop import run

    datasets.disable_progress_bars()
    root, res = Path(base["output_dir"]), {}

    def train(name: str, **kw: Any) -> list[tuple[int, float]]:
        summary = run(load_config_dict({**base, "output_dir": str(root / name), **kw}))
        return [(r["step"], r["loss"]) for r in summary.get("history", []) if "loss" in r]

    def committed(name: str) -> dict[str, str | None]:
        return {p.name: verify_checkpoint(p) for p in list_checkpoints(root / name)}

    # 1, 2. parity with a synchronous run, commit, verification, resume, rotation
    res["sync"] = train("sync", max_steps=6, save_steps=2)
    res["async"] = train("async", max_steps=6, save_steps=2, async_save=True)
    res["async_committed"] = committed("async")
    ckpt2 = str(root / "async" / "checkpoint-2")
    res["resumed"] = train(
        "async", max_steps=6, save_steps=2, async_save=True, resume_from_checkpoint=ckpt2, save_total_limit=1
    )
    res["after_rotation"] = committed("async")

    # 3. a write fails on rank 1 only, in the writer thread
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, limits[1]))
    try:
        train("full", max_steps=2, save_steps=1, async_save=True)
        res["full_disk"] = "no error"
    except OSError as e:
        res["full_disk"] = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    dist.barrier()
    full = root / "full"
    res["full_left"] = sorted(p.name for p in full.iterdir() if p.name.startswith("checkpoint-"))
    res["full_markers"] = sorted(str(p.relative_to(full)) for p in full.rglob(COMMIT_MARKER))

    # 4. preemption while a save is in flight
    os.environ["TRAINER_FAULT_INJECT"] = "term:rank=0:step=3"
    try:
        train("preempt", max_steps=6, save_steps=2, async_save=True)
        res["preempted"] = "no error"
    except Preempted as e:
        res["preempted"] = str(e)
    finally:
        del os.environ["TRAINER_FAULT_INJECT"]
    res["preempt_committed"] = committed("preempt")

    # 5. FSDP over dp=2: parameters and AdamW moments are DTensors sharded over dp
    fsdp = mesh_overrides(dp=2, data_parallel_sharding="fsdp")
    res["fsdp_sync"] = train("fsdp-sync", max_steps=4, save_steps=2, **fsdp)
    res["fsdp_async"] = train("fsdp-async", max_steps=4, save_steps=2, async_save=True, **fsdp)
    ckpt2 = str(root / "fsdp-async" / "checkpoint-2")
    res["fsdp_resumed"] = train(
        "fsdp-async", max_steps=4, save_steps=2, async_save=True, resume_from_checkpoint=ckpt2, **fsdp
    )
    res["fsdp_committed"] = committed("fsdp-async")
    return res


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("async")
    base = base_config(str(tmp), builtin_size=300, **mesh_overrides(tp=2))
    env = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return run_distributed(async_story, 2, args=(base,), timeout=280, env=env, collective_timeout=90)


def test_async_run_matches_sync_and_resumes_exactly(story: list[dict[str, Any]]) -> None:
    r0 = story[0]
    sync = dict(r0["sync"])
    assert [s for s, _ in r0["async"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in r0["resumed"]] == [3, 4, 5, 6]  # resumed from checkpoint-2
    for step, loss in r0["async"] + r0["resumed"]:
        assert loss == pytest.approx(sync[step], rel=1e-6, abs=1e-7), (step, loss, sync[step])
    # checkpoint-2 was written while step 3 updated the weights: staged, then committed and verified.
    assert r0["async_committed"] == {"checkpoint-2": None, "checkpoint-4": None, "checkpoint-6": None}
    assert r0["after_rotation"] == {"checkpoint-6": None}  # save_total_limit=1, applied after each commit


def test_async_write_failure_is_agreed_and_leaves_no_marker(story: list[dict[str, Any]]) -> None:
    r0, r1 = story
    line = r0["full_disk"]
    assert line == r1["full_disk"] and "\n" not in line, (line, r1["full_disk"])
    assert line.startswith("CheckpointWriteError: saving checkpoint") and "checkpoint-1 failed on rank 1" in line
    assert "EFBIG" in line and "the partial checkpoint was removed" in line
    assert "checkpoint-1" not in r0["full_left"] and r0["full_markers"] == []


def test_preemption_waits_for_the_save_in_flight(story: list[dict[str, Any]]) -> None:
    r0, r1 = story
    assert r0["preempted"].startswith("SIGTERM at step 3: saved") and r1["preempted"] == r0["preempted"]
    assert r0["preempt_committed"] == {"checkpoint-2": None, "checkpoint-3": None}


def test_async_save_under_fsdp_resumes_exactly(story: list[dict[str, Any]]) -> None:
    r0 = story[0]
    sync = dict(r0["fsdp_sync"])
    assert [s for s, _ in r0["fsdp_async"]] == [1, 2, 3, 4] and [s for s, _ in r0["fsdp_resumed"]] == [3, 4]
    for step, loss in r0["fsdp_async"] + r0["fsdp_resumed"]:
        assert loss == pytest.approx(sync[step], rel=1e-6, abs=1e-7), (step, loss, sync[step])
    assert r0["fsdp_committed"] == {"checkpoint-2": None, "checkpoint-4": None}
