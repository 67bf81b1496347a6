"""How long a process lives: the signals that stop a run, and the watch on a parent it must not outlive.

STOP_SIGNALS    SIGTERM and SIGUSR1 (a scheduler's notice), SIGINT (Ctrl-C), SIGHUP (a hangup, or the
                launcher's death below). A training rank saves at the next step boundary and exits
                (trainer/run/guard.py::PreemptionSignals); its data workers ignore them all (they end
                with their rank: a Ctrl-C reaches the whole foreground process group, SLURM signals
                every process of a step).
ParentWatch     the parent seen at the start, watched two ways: the kernel sends a chosen signal when
                it dies (Linux PR_SET_PDEATHSIG), and `gone()` compares getppid() with it (everywhere,
                and for a parent that died before the request). Two users:
                  data workers (trainer/data/workers.py): SIGKILL, and the worker loop's check: a
                    worker never outlives the rank that reads it;
                  ranks started by torchrun (`for_launcher`, trainer/train.py): SIGHUP, and the step
                    guard's check: a rank whose agent was SIGKILLed saves and exits instead of training
                    on unsupervised (torchrun starts each worker in a session of its own, so nothing
                    else reaches it, and a relaunch would meet a live run).

Only under torchrun: a plain `python -m trainer.train` whose shell goes away (`nohup`, `&`) trains on,
as any program does. A rank forked by something else under torchrun's variables (the doc tests' fork
server) watches that parent, which outlives it. Standard library only: a data worker imports it.
"""

from __future__ import annotations

import os
import signal
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
# What a rank is sent when its agent dies; signal(7): SIGHUP, "death of controlling process".
LAUNCHER_GONE = signal.SIGHUP
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ParentWatch:
    """This process's parent (at construction), and a request to be sent `death_signal` when it dies.

    Args:
        death_signal: what the kernel sends this process when the parent dies (Linux only; the thread
            that forked it, in fact: a launcher spawning from its main thread, as torchrun and
            multiprocessing do).
    """

    def __init__(self, death_signal: int) -> None:
        self.pid = os.getppid()
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(death_signal))
            except (OSError, AttributeError):
                pass  # the check below still works

    def gone(self) -> bool:
        """Whether the parent has died (this process was re-parented; also when it died before the request)."""
        return os.getppid() != self.pid

    @classmethod
    def for_launcher(cls) -> ParentWatch | None:
        """A watch on torchrun's agent for a rank it started (LAUNCHER_GONE on its death), else None."""
        return cls(LAUNCHER_GONE) if os.environ.get("TORCHELASTIC_RUN_ID") else None


def ignore_stop_signals() -> None:
    """For a helper process that ends with its parent: STOP_SIGNALS do nothing here (call in its main thread)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
