"""The signals that stop a run (trainer/run/guard.py::PreemptionSignals, trainer/lifetime.py), each in a
forked child of this process (no imports to pay), so that a signal or an exit never reaches pytest.

The story (issue 36): Ctrl-C printed a 68-line KeyboardInterrupt traceback and lost the progress
since the last checkpoint; under torchrun it gave 149 lines, 4 tracebacks and exit 1. A second
Ctrl-C must stop at once, also while the main thread waits in a collective, where no Python signal
handler runs: the process is blocked here in `os.read` of a pipe nobody writes to, and only the
watcher thread can end it. And a rank whose torchrun agent was SIGKILLed trained on unsupervised.
(tests/dist/test_faults_guard.py runs the same through torchrun.)
"""

from __future__ import annotations

import os
import select
import signal
import time
import traceback
from collections.abc import Callable

import pytest

from trainer.lifetime import LAUNCHER_GONE, ParentWatch
from trainer.run.guard import EXIT_INTERRUPTED, EXIT_PREEMPTED, Preempted, PreemptionSignals

ANNOUNCED = "SIGINT: a checkpoint is saved at the next step boundary, then the run exits; Ctrl-C again"
ABORTED = "interrupted again: stopped at once without saving (exit code 130)"


def _in_child(body: Callable[[], int], timeout: float = 20.0) -> tuple[int, str]:
    """Run `body` in a forked child whose stderr is captured: (its exit status as subprocess gives
    it, -N for signal N; its stderr). The child exits with `body`'s return value."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 99
        try:
            os.dup2(w, 2)
            _as_a_fresh_process()
            status = body()
        except SystemExit as e:
            status = int(e.code or 0)
        except BaseException:  # noqa: BLE001 - reported through stderr and status 99
            os.write(2, traceback.format_exc().encode())
        finally:
            os._exit(status)
    os.close(w)
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the child did not end within {timeout} s")
        time.sleep(0.02)
    with os.fdopen(r, "rb") as f:
        err = f.read().decode()
    return os.waitstatus_to_exitcode(done[1]), err


def _as_a_fresh_process() -> None:
    """The signal state of a process a user starts from a terminal. pytest's need not be that: a suite
    started in the background of a non-interactive shell (`pytest ... &` in a script) runs with
    SIGINT ignored, which a fork inherits, and the Ctrl-C tests then hung or saw no signal."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)


def _block_forever() -> None:
    """Wait in a system call that nothing ends: Python's handlers run but cannot stop the process."""
    r, _w = os.pipe()
    os.read(r, 1)


def test_second_ctrl_c_stops_at_once_while_the_main_thread_waits() -> None:
    def body() -> int:
        with PreemptionSignals():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)
            _block_forever()
        return 1

    code, err = _in_child(body)
    assert code == EXIT_INTERRUPTED, err
    assert err.splitlines()[0].startswith(ANNOUNCED) and err.splitlines()[1].startswith(ABORTED), err
    assert len(err.splitlines()) == 2 and "Traceback" not in err


def test_sigterm_after_ctrl_c_stops_at_once_sigint_after_sigterm_does_not() -> None:
    """torchrun's agent answers a second Ctrl-C with SIGTERM to its workers: that is the second
    interrupt. A scheduler's SIGTERM followed by one Ctrl-C is not: the save goes on."""

    def interrupted_then_terminated() -> int:
        with PreemptionSignals(announce=False):  # a rank other than 0: silent
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGTERM)
            _block_forever()
        return 1

    assert _in_child(interrupted_then_terminated) == (EXIT_INTERRUPTED, "")

    def terminated_then_interrupted() -> int:
        with PreemptionSignals() as signals:
            for s in (signal.SIGTERM, signal.SIGINT):
                os.kill(os.getpid(), s)
                time.sleep(0.3)
            return 0 if signals.pending() == signal.SIGTERM else 1

    code, err = _in_child(terminated_then_interrupted)
    assert code == 0 and err.startswith(ANNOUNCED) and ABORTED not in err, err


def test_signals_ignored_at_the_start_stay_ignored_and_handlers_come_back() -> None:
    """`nohup` and a script's background jobs ignore SIGHUP / SIGINT: such a run trains on."""

    def body() -> int:
        for s in (signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        before = signal.getsignal(signal.SIGTERM)
        with PreemptionSignals() as signals:
            for s in (signal.SIGINT, signal.SIGHUP, signal.SIGINT):
                os.kill(os.getpid(), s)
                time.sleep(0.1)
            ignored = signals.pending() == 0 and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR1)
            got = signals.pending()
        restored = signal.getsignal(signal.SIGTERM) == before and signal.set_wakeup_fd(-1) == -1
        return 0 if ignored and got == signal.SIGUSR1 and restored else 1

    assert _in_child(body) == (0, "")


def test_a_process_forked_inside_does_not_count_as_a_second_ctrl_c() -> None:
    """A child forked while the handlers are in place (it shares the wakeup socket) takes its own
    Ctrl-C; the parent's one Ctrl-C must still save, not abort."""

    def body() -> int:
        with PreemptionSignals() as signals:
            pid = os.fork()
            if pid == 0:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
                os._exit(0)
            os.waitpid(pid, 0)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
            return 0 if signals.pending() == signal.SIGINT else 1

    code, err = _in_child(body)
    assert code == 0 and err.count(ANNOUNCED) == 1 and ABORTED not in err, err


def test_ctrl_c_exit_status_and_line() -> None:
    """130 as a shell reports Ctrl-C, by dying of SIGINT (so a calling shell script stops too); 75
    (requeue) for the scheduler's signals and a dead launcher."""
    from trainer.train import exit_with

    assert _in_child(lambda: exit_with(EXIT_INTERRUPTED)) == (-signal.SIGINT, "")
    assert _in_child(lambda: exit_with(EXIT_PREEMPTED)) == (EXIT_PREEMPTED, "")
    e = Preempted(7, signal.SIGINT, "out/checkpoint-7")
    assert e.exit_code == 130 and str(e) == (
        "SIGINT at step 7: saved out/checkpoint-7; resume with --resume_from_checkpoint latest (exit code 130)"
    )
    assert Preempted(7, signal.SIGTERM, "c").exit_code == Preempted(7, LAUNCHER_GONE, "c").exit_code == 75


def test_ctrl_c_during_set_up_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before the steps' handlers are in place (data, tokenizer, model) Ctrl-C is Python's
    KeyboardInterrupt: one line and 130, not its traceback."""
    from pathlib import Path

    from trainer import train

    def interrupted(cfg, launcher=None):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    for var in ("TRAINER_TRACEBACK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    assert train.cli(["--config", str(tiny), "--output_dir", str(tmp_path / "out")]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err.startswith("interrupted: SIGINT outside the training steps") and err.count("\n") == 1, err


def test_a_rank_learns_that_its_launcher_died() -> None:
    """The kernel signals a watched child when its parent dies, and `gone()` sees the new parent;
    the guard then reports LAUNCHER_GONE with the cause in words."""
    r, w = os.pipe()

    def launcher() -> int:  # forks the "rank", waits until it watches, then dies
        ready_r, ready_w = os.pipe()
        if os.fork() == 0:
            got: list[int] = []
            signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
            watch = ParentWatch(signal.SIGUSR2)
            os.write(ready_w, b"x")
            deadline = time.monotonic() + 10
            while not (got and watch.gone()) and time.monotonic() < deadline:
                time.sleep(0.02)
            guard = PreemptionSignals(launcher=watch)
            report = f"{got} {watch.gone()} {guard.pending()} {guard.cause(guard.pending())}"
            os.write(w, report.encode())
            os._exit(0)
        os.read(ready_r, 1)
        return 0

    assert _in_child(launcher)[0] == 0
    os.close(w)
    assert select.select([r], [], [], 15)[0], "the rank did not report"
    report = os.read(r, 4096).decode()
    os.close(r)
    assert report.startswith(
        f"[{int(signal.SIGUSR2)}] True {int(LAUNCHER_GONE)} the launcher (torchrun agent, pid "
    )
    assert report.endswith(") died"), report


def test_only_torchrun_ranks_watch_their_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain `python -m trainer.train` trains on when its shell goes away (nohup, &)."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert ParentWatch.for_launcher() is None
