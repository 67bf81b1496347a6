"""A one-line error under torchrun: printed once, named in torchrun's own summary, one failure listed.

Issue 36: under `torchrun --nproc-per-node N` a config error was printed by every rank, and torchrun's
ChildFailedError summary listed every rank (N blocks) with "To enable traceback see: <link>" as the
cause. `trainer.exit_status` is checked here against torch's own parser of the error file and with
small processes that import nothing but it; tests/dist/test_faults_guard.py runs it under torchrun.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.exit_status import fail_in_one_line

ROOT = Path(__file__).resolve().parents[2]
LINE = "error: ConfigError: max_steps=0 must be >= 1, or -1 to train num_train_epochs"


def test_outside_torchrun_every_process_prints_its_line(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")  # srun or a test harness: no agent stops the others
    assert fail_in_one_line(LINE, 2, grace_s=30) == 2
    assert capsys.readouterr().err == LINE + "\n"


def test_torchruns_summary_names_the_cause(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """The error file is read by torch's own ProcessFailure: its summary shows the line, not the link."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert fail_in_one_line(LINE, 2) == 2
    assert capsys.readouterr().err == LINE + "\n"  # local rank 0 prints it
    failure = ProcessFailure(local_rank=0, pid=1234, exitcode=2, error_file=str(error_file))
    summary = ChildFailedError("trainer.train", {0: failure}).format_msg()
    assert f"traceback : {LINE}" in summary and "To enable traceback" not in summary, summary


def test_local_rank_0_waits_until_the_others_met_it_too(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """So that torchrun's SIGTERM finds them waiting for it (exit 0), not still on their way (killed,
    listed as failures): local rank 0 leaves once the node's other error files exist, or after the grace."""
    import threading

    attempt = tmp_path / "attempt_0"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "0" / "error.json"))
    (attempt / "0").mkdir(parents=True)
    start = time.monotonic()
    assert fail_in_one_line(LINE, 2, grace_s=0.3) == 2  # local rank 1 never failed: after the grace
    assert time.monotonic() - start >= 0.3
    (attempt / "0" / "error.json").unlink()
    (attempt / "1").mkdir()
    threading.Timer(0.5, (attempt / "1" / "error.json").write_text, args=("{}",)).start()
    start = time.monotonic()
    assert fail_in_one_line(LINE, 2, grace_s=60) == 2
    assert 0.5 <= time.monotonic() - start < 30
    assert capsys.readouterr().err == 2 * (LINE + "\n")


def _worker(tmp_path: Path, grace_s: float) -> tuple[subprocess.Popen[str], Path]:
    """A process in local rank 1's place meeting the error (it imports trainer.exit_status only), with
    torchrun's layout of error files: tmp_path/attempt_0/<local rank>/error.json."""
    error_file = tmp_path / "attempt_0" / "1" / "error.json"
    error_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHELASTIC_RUN_ID": "run", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_ERROR_FILE": str(error_file)}  # fmt: skip
    code = f"import sys; from trainer.exit_status import fail_in_one_line; sys.exit(fail_in_one_line({LINE!r}, 2, {grace_s}))"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    return proc, error_file


def _stop_when_waiting(proc: subprocess.Popen[str], after_s: float = 0.0) -> None:
    """SIGTERM `proc`, as torchrun's agent does, `after_s` seconds after it set its handler."""
    deadline = time.monotonic() + 30
    while not _catches_sigterm(proc.pid):  # the agent's SIGTERM may come from here on
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(after_s)
    proc.send_signal(signal.SIGTERM)


def test_other_ranks_leave_quietly_when_the_agent_stops_them(tmp_path: Path) -> None:
    """torchrun SIGTERMs the other workers once local rank 0 failed: they exit 0 then (not listed as
    failures of their own) and print nothing."""
    proc, error_file = _worker(tmp_path, grace_s=60)
    _stop_when_waiting(proc)
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (0, "")
    assert LINE in error_file.read_text()


def test_other_ranks_wait_past_the_grace_while_local_rank_0_fails_too(tmp_path: Path) -> None:
    """Local rank 0 met the error too (its error file is there) but waits for its slower siblings:
    the others keep waiting for the agent past their own grace, not printing the line themselves."""
    (tmp_path / "attempt_0" / "0").mkdir(parents=True)
    (tmp_path / "attempt_0" / "0" / "error.json").write_text("{}")
    proc, _ = _worker(tmp_path, grace_s=0.3)
    _stop_when_waiting(proc, after_s=0.4)
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (0, "")


def test_a_rank_of_its_own_error_prints_it_after_the_grace(tmp_path: Path) -> None:
    """Local rank 0 wrote no error file within the grace: the error was this rank's alone; it prints
    it and fails."""
    proc, _ = _worker(tmp_path, grace_s=0.3)
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (2, LINE + "\n")


def _catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGTERM (Linux: the SigCgt mask of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False
