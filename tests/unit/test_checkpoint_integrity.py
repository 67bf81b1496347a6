"""Checkpoint integrity and the output directory, in one process (no process group).

Each test pins a failure seen on a real run before the fix:
- 64 KiB overwritten inside a shard of the newest checkpoint loaded silently and
  trained on NaN: now the marker's crc32 names the file, `latest` falls back to the
  previous checkpoint with a warning, and a named one is an error;
- a disk filling during a save gave DCP's "unexpected pos 704 vs 598": now one line
  says the disk is full (a real ENOSPC from /dev/full; a real EFBIG from
  RLIMIT_FSIZE during a save), the partial directory is gone, the previous
  checkpoint still verifies and loads, and save_total_limit deleted nothing;
- `overwrite_output_dir` kept the earlier run's checkpoints, which `latest` then
  picked: now a fresh start moves them aside (removed at the new run's first commit), a
  torchrun restart keeps them;
- two runs on one output_dir both ran: now the second one's lock fails naming the holder.

tests/dist/test_faults_checkpoint.py runs the same cases through the trainer on 2 gloo ranks.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import signal
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.checkpoint import dcp as ckpt
from trainer.checkpoint.commit import (
    COMMIT_MARKER,
    CheckpointCorruptError,
    list_checkpoints,
    share_of,
    verify_checkpoint,
)
from trainer.checkpoint.write_failure import describe_write_failure
from trainer.config.training_args import TrainingArguments
from trainer.errors import ConfigError
from trainer.export import main as export_main
from trainer.run.outdir import EARLIER_RUN, OutputDirBusyError, OutputDirLock, claim_output_dir


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(256, 256)  # 257 KiB of weights, 3x that with AdamW's state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def _save(out: Path, step: int, limit: int | None = None) -> Path:
    model, opt = _model_and_optimizer()
    path = ckpt.checkpoint_dir(out, step)
    ckpt.save_checkpoint(path, [model], opt, {"step": step}, save_total_limit=limit)
    return path


def _damage(path: Path, offset: int = 64 << 10, size: int = 64 << 10) -> None:
    """Overwrite `size` bytes at `offset` with 0xFF (what the NaN-loading run had)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * size)


def _shard(path: Path) -> Path:
    return max(path.glob("__*.distcp"), key=lambda p: p.stat().st_size)


def test_marker_records_every_file_and_verifies(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    marker = json.loads((path / COMMIT_MARKER).read_text())
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {COMMIT_MARKER}
    assert set(marker["files"]) == on_disk
    assert {".metadata", "trainer_state.json", "rng/rank-0.pt"} <= on_disk
    assert marker["algorithm"] == "crc32" and marker["step"] == 3
    assert verify_checkpoint(path) is None


def test_damaged_shard_is_named_in_one_line(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    shard = _shard(path)
    _damage(shard)
    problem = verify_checkpoint(path)
    assert problem is not None and "\n" not in problem
    recorded = json.loads((path / COMMIT_MARKER).read_text())["files"][shard.name]["crc32"]
    assert shard.name in problem and f"the marker recorded {recorded}" in problem
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        ckpt.resolve_resume(str(path), tmp_path)

    with open(shard, "r+b") as f:  # truncated: the size tells
        f.truncate(1000)
    assert "has 1000 bytes" in (verify_checkpoint(path) or "")
    other = _save(tmp_path, 5)
    (other / "rng" / "rank-0.pt").unlink()
    assert "rng/rank-0.pt is missing" in (verify_checkpoint(other) or "")


def test_latest_falls_back_to_previous_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    older, newest = _save(tmp_path, 2), _save(tmp_path, 4)
    assert ckpt.resolve_resume("latest", tmp_path) == newest
    _damage(_shard(newest))
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert ckpt.resolve_resume("latest", tmp_path) == older
    assert any("skipping it" in r.message and _shard(newest).name in r.message for r in caplog.records)
    model, opt = _model_and_optimizer()
    assert ckpt.load_checkpoint(older, [model], opt)["step"] == 2
    _damage(_shard(older))
    with pytest.raises(CheckpointCorruptError, match="every committed checkpoint"):
        ckpt.resolve_resume("latest", tmp_path)


def test_marker_without_checksums_loads_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _save(tmp_path, 5)
    (path / COMMIT_MARKER).write_text("ok\n")  # written before checksums
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert ckpt.resolve_resume("latest", tmp_path) == path
    assert any("without checksums" in r.message for r in caplog.records)
    (path / COMMIT_MARKER).write_text("{not json")
    assert "marker is unreadable" in (verify_checkpoint(path) or "")


def test_export_refuses_a_damaged_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _save(tmp_path / "run", 3)
    _damage(_shard(path))
    assert export_main(["--checkpoint", str(path), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged" in err[0] and _shard(path).name in err[0], err
    assert not (tmp_path / "hf").exists()


def test_verification_shares_cover_each_file_once() -> None:
    records = {f"f{i}": {"size": s, "crc32": "0"} for i, s in enumerate([9, 1, 5, 5, 0, 7, 3])}
    shares = [share_of(records, r, 3) for r in range(3)]
    assert sorted(n for s in shares for n in s) == sorted(records)
    assert shares[0][0] == "f0"  # the largest file goes first, to rank 0


def test_disk_full_message_from_a_real_enospc(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    with pytest.raises(OSError) as info, open("/dev/full", "wb", buffering=0) as f:
        f.write(b"x" * 4096)
    assert info.value.errno == errno.ENOSPC
    line = describe_write_failure(tmp_path / "checkpoint-4", info.value, rank=0)
    assert "the disk is full" in line and "ENOSPC" in line and "MiB free" in line
    assert "last committed: checkpoint-2" in line and "\n" not in line


def test_failed_save_removes_partial_dir_and_keeps_previous(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes write(2) fail with EFBIG where a full disk gives ENOSPC: the same call in
    DCP's writer raises, through the same handling (SIGXFSZ is ignored, as Python does at start-up)."""
    older = _save(tmp_path, 2, limit=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (128 << 10, hard))
    try:
        with pytest.raises(ckpt.CheckpointWriteError) as info:
            _save(tmp_path, 4, limit=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    line = str(info.value)
    assert "EFBIG" in line and "failed on rank 0" in line and "last committed: checkpoint-2" in line
    assert "\n" not in line
    assert not (tmp_path / "checkpoint-4").exists()
    assert list_checkpoints(tmp_path) == [older] and verify_checkpoint(older) is None
    model, opt = _model_and_optimizer()
    assert ckpt.load_checkpoint(older, [model], opt)["step"] == 2


def test_second_lock_fails_naming_the_holder(tmp_path: Path) -> None:
    first, second = OutputDirLock(tmp_path), OutputDirLock(tmp_path)
    first.acquire()
    with pytest.raises(OutputDirBusyError) as info:
        second.acquire()
    msg = str(info.value)
    assert f"host {socket.gethostname()}, pid {os.getpid()}, since 20" in msg and "\n" not in msg
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()  # the holder's record stays
    first.release()
    second.acquire()  # released: the next run takes it
    second.release()


def _previous_run(out: Path) -> None:
    for name in ("checkpoint-30", "checkpoint-31", "tokenizer"):
        (out / name).mkdir(parents=True)
    (out / "checkpoint-30" / COMMIT_MARKER).write_text("ok\n")
    names = ("metrics.jsonl", "run_summary.json", "config.yaml", "model_config.json", "notes.txt")
    for name in (*names, "predict_results.json", "predictions_en-de.txt", "generated_predictions.txt"):
        (out / name).write_text("earlier run")


def _args(out: Path, **kw: object) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), **kw)  # type: ignore[arg-type]


def test_overwrite_moves_the_earlier_run_aside_until_the_first_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (issue 23): overwrite_output_dir deleted every committed checkpoint before the new
    run had saved anything (a crash then lost both runs). Now they are renamed aside, where
    `latest` cannot pick them, and removed only once the new run commits its first checkpoint."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    _previous_run(tmp_path)
    held = tmp_path / EARLIER_RUN
    with caplog.at_level(logging.INFO, logger="trainer"):
        with claim_output_dir(_args(tmp_path, overwrite_output_dir=True), rank=0) as out:
            assert sorted(p.name for p in out.iterdir()) == [
                ".lock",
                "notes.txt",
                EARLIER_RUN,
            ]  # notes: not ours
            assert ckpt.resolve_resume("latest", out) is None
            assert (held / "checkpoint-30" / COMMIT_MARKER).is_file() and (held / "tokenizer").is_dir()
            assert (held / "predictions_en-de.txt").is_file()  # do_predict's files are the run's too
            with pytest.raises(OutputDirBusyError):  # held for the block's life
                OutputDirLock(out).acquire()
        assert any("moved the earlier run's outputs" in r.message for r in caplog.records)
        free = OutputDirLock(tmp_path)
        free.acquire()  # released after the block
        free.release()

        # interrupted before its first commit: a second overwrite keeps the held run (still the last
        # committed one) and drops the interrupted run's outputs
        (tmp_path / "checkpoint-2").mkdir()  # no marker: never committed
        (tmp_path / "metrics.jsonl").write_text("interrupted run")
        with claim_output_dir(_args(tmp_path, overwrite_output_dir=True), rank=0):
            assert (held / "checkpoint-30" / COMMIT_MARKER).is_file() and (held / "metrics.jsonl").is_file()
            assert not (tmp_path / "checkpoint-2").exists() and not (tmp_path / "metrics.jsonl").exists()
        caplog.clear()
        _save(tmp_path, 5)  # the new run's first commit removes the earlier run
    assert not held.exists() and ckpt.resolve_resume("latest", tmp_path) == tmp_path / "checkpoint-5"
    assert any("removed the earlier run's outputs" in r.message for r in caplog.records)


def test_restart_and_resume_keep_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _previous_run(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's restart of the same run
    with claim_output_dir(_args(tmp_path, overwrite_output_dir=True), rank=0):
        pass
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with claim_output_dir(
        _args(tmp_path, overwrite_output_dir=True, resume_from_checkpoint="latest"), rank=0
    ):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, ".lock"])


def test_fresh_run_refuses_non_empty_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with claim_output_dir(_args(tmp_path), rank=0):  # empty
        pass
    with claim_output_dir(_args(tmp_path), rank=0):  # only the lock file: still empty
        pass
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="is not empty"), claim_output_dir(_args(tmp_path), rank=0):
        pass
    OutputDirLock(tmp_path).acquire()  # a refused claim does not keep the lock
