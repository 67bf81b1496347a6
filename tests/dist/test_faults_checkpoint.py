"""Checkpoint and output-directory faults through the real trainer, on 2 gloo ranks (dp=2).

One spawned group runs the story in order (spawning and set-up dominate the cost):

1. a run saves checkpoint-2 and checkpoint-4; 64 KiB inside a shard of checkpoint-4
   are overwritten (before: it loaded silently and trained on NaN);
   - naming checkpoint-4 is an error on every rank, one line naming the shard;
   - `latest` skips it with a warning, resumes from checkpoint-2, and the losses are finite;
2. rank 1 alone hits a file-size limit (RLIMIT_FSIZE -> EFBIG, the same failed write(2)
   as ENOSPC) while saving checkpoint-6 (before: "unexpected pos 704 vs 598"): both ranks
   raise the same one-line error naming rank 1 and the cause, nobody hangs, the partial
   checkpoint-6 is gone, and the next run resumes from checkpoint-5;
3. another process holds output_dir's lock (before: two runs interleaved metrics.jsonl):
   the run fails at once on both ranks naming the holder's host and pid;
4. a torchrun restart (TORCHELASTIC_RESTART_COUNT=1) of an overwrite run keeps the
   checkpoints; a fresh overwrite run moves them aside before it starts and removes them
   when it commits its own checkpoint (before: an earlier run's checkpoint-30 stayed and
   `latest` resumed a new run from it; then: they were deleted before the new run saved).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
HOLD_LOCK = (
    "import sys; from trainer.run.outdir import OutputDirLock; OutputDirLock(sys.argv[1]).acquire(); "
    "print('held', flush=True); sys.stdin.read()"
)


def _damage(path: Path, offset: int = 64 << 10, size: int = 64 << 10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * size)


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def fault_story(rank: int, world: int, base: dict[str, Any]) -> dict[str, Any]:
    """The four cases above, in order; returns what each rank saw."""
    import logging
    import resource
    import subprocess
    import sys

    import torch.distributed as dist

    from trainer.checkpoint import dcp as ckpt
    from trainer.config.parse import load_config_dict
    from trainer.run.outdir import claim_output_dir
    from trainer.run.loop import run

    out, res = Path(base["output_dir"]), {}

    def train(**kw: Any) -> list[tuple[int, float]]:
        if kw.get("resume_from_checkpoint"):
            kw["tokenizer_name"] = None  # as the run being resumed had it (a resume keeps its tokenizer)
        summary = run(load_config_dict({**base, **kw}))
        return [(r["step"], r["loss"]) for r in summary.get("history", []) if "loss" in r]

    def error_of(**kw: Any) -> str:
        try:
            train(**kw)
        except (ValueError, OSError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    # 1. damaged shard
    train(max_steps=4, save_steps=2, tokenizer_name=None)
    if rank == 0:
        shutil.copytree(out / "tokenizer", Path(base["tokenizer_name"]))
        _damage(out / "checkpoint-4" / "__0_0.distcp")
    dist.barrier()
    try:
        ckpt.resolve_resume(str(out / "checkpoint-4"), out)
        res["explicit"] = "no error"
    except ckpt.CheckpointCorruptError as e:
        res["explicit"] = str(e)
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainer").addHandler(handler)
    res["fallback_losses"] = train(max_steps=5, save_steps=2, resume_from_checkpoint="latest")
    logging.getLogger("trainer").removeHandler(handler)
    res["warnings"] = warned

    # 2. a write fails on rank 1 only
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, limits[1]))
    try:
        res["full_disk"] = error_of(max_steps=6, resume_from_checkpoint="latest")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    dist.barrier()
    res["after_full_disk"] = _names(out)
    res["resumed_losses"] = train(max_steps=6, resume_from_checkpoint="latest")

    # 3. another process holds the lock
    holder = None
    if rank == 0:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(out)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        res["holder_pid"] = holder.pid
    try:
        dist.barrier()
        res["busy"] = error_of(max_steps=1)
    finally:
        if holder is not None:
            holder.communicate(timeout=30)

    # 4. restart keeps, fresh overwrite clears
    before = _names(out)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    with claim_output_dir(load_config_dict({**base, "max_steps": 1}).training, rank):
        pass
    del os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.barrier()
    res["restart_kept"] = _names(out) == before
    res["fresh_losses"] = train(max_steps=1)
    res["fresh"] = _names(out)
    return res


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("faults")
    base = base_config(str(tmp), tokenizer_dir=str(tmp / "tok"), builtin_size=300, plots=True)
    env = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = run_distributed(fault_story, 2, args=(base,), timeout=240, env=env, collective_timeout=60)
    return Path(base["output_dir"]), results


def test_damaged_shard_named_and_latest_falls_back(story: tuple[Path, list[dict[str, Any]]]) -> None:
    _, (r0, r1) = story
    line = r0["explicit"]
    assert line == r1["explicit"] and "\n" not in line
    assert "checkpoint-4 is damaged: __0_0.distcp has crc32" in line and "the marker recorded" in line
    assert any("skipping it" in w and "__0_0.distcp" in w for w in r0["warnings"]), r0["warnings"]
    losses = r0["fallback_losses"]
    assert [s for s, _ in losses] == [3, 4, 5]  # resumed from checkpoint-2
    assert all(math.isfinite(x) for _, x in losses), losses


def test_failed_write_on_one_rank_is_agreed_and_cleaned(story: tuple[Path, list[dict[str, Any]]]) -> None:
    _, (r0, r1) = story
    line = r0["full_disk"]
    assert line == r1["full_disk"] and "\n" not in line, (line, r1["full_disk"])
    assert line.startswith("CheckpointWriteError: saving checkpoint") and "checkpoint-6 failed on rank 1" in line
    assert "EFBIG" in line and "MiB free" in line and "last committed: checkpoint-5" in line
    assert [n for n in r0["after_full_disk"] if n.startswith("checkpoint-")] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
    assert [s for s, _ in r0["resumed_losses"]] == [6]  # checkpoint-5 was intact and loadable
    assert math.isfinite(r0["resumed_losses"][0][1])


def test_second_run_on_a_held_output_dir_fails_naming_the_holder(
    story: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, (r0, r1) = story
    line = r0["busy"]
    assert line == r1["busy"] and "\n" not in line
    assert line.startswith("OutputDirBusyError:") and f"pid {r0['holder_pid']}, since " in line


def test_overwrite_clears_the_earlier_run_but_a_restart_keeps_it(
    story: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, (r0, _) = story
    assert r0["restart_kept"]
    assert r0["fresh"] == [
        ".lock",
        "checkpoint-1",
        "config.yaml",  # no overwritten_run/: removed when checkpoint-1 was committed
        "curves.png",
        "data_cache",  # the tokenized data outlives a fresh overwrite: the next run loads it
        "metrics.jsonl",
        "model_config.json",
        "run_summary.json",
        "tokenizer",
    ]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and r0["fresh_losses"][0][0] == 1
