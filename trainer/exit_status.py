"""How an entry point ends on an error it reports in one line (bad input, a divergence, a failed
checkpoint write): the line printed once, the exit status, and, under torchrun, what torchrun shows.

Outside torchrun every process prints its line. Under torchrun (its agent sets TORCHELASTIC_RUN_ID)
a config error is met by every rank alike, and torchrun itself adds a ChildFailedError summary
(~30 lines) listing every worker that exited non-zero. torch 2.13's agent
(`torch/distributed/elastic`) prints that summary, and retries the group up to `--max-restarts`
times, for *any* non-zero exit: no exit status or error-file field makes a failure final (its
`errorTraits` "retryability" is written but never read; only a worker stuck in D-state disables
restarts). What a worker can do, and `fail_in_one_line` does:

    every failing rank    writes its line into torchrun's error file (TORCHELASTIC_ERROR_FILE, the
                          JSON `torch.distributed.elastic.multiprocessing.errors.ErrorHandler`
                          writes), so the summary shows the cause instead of a link to the docs
    local rank 0          waits (up to GRACE_S) until the node's other workers have met an error too
                          (their error files exist: they wait as below, rather than being killed
                          mid-way by the agent and listed as failures), prints the line and exits
                          with the status
    other local ranks     wait up to GRACE_S for the agent's SIGTERM, which comes as soon as a
                          worker of the node failed (local rank 0, with the same error), and exit 0
                          on it: the summary lists one failure, not one per rank. No SIGTERM within
                          GRACE_S: the error is this rank's own; it prints it and exits with the status

torchrun's own exit status is then 1 (it never forwards a worker's); what it prints besides is its
own: a "Sending process ... closing signal SIGTERM" line per other worker, the failure, a note that
its parent has no error file, and the ChildFailedError traceback with the summary (about 34 lines
in all for 2 ranks, 36 for 4, against 42 and 60 before). Under `--max-restarts N` all of it comes
once per attempt: a config error is retried N times (each attempt fails within its imports).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

GRACE_S = 20.0  # how long a rank other than local rank 0 waits for the agent's SIGTERM


def under_torchrun() -> bool:
    """A worker started by torchrun's elastic agent (which sets TORCHELASTIC_RUN_ID for its workers)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def fail_in_one_line(line: str, status: int, grace_s: float = GRACE_S) -> int:
    """Report `line` as the module docstring says and return the exit status for `sys.exit` (under
    torchrun, a rank other than local rank 0 may instead exit 0 here, on the agent's SIGTERM)."""
    if not under_torchrun():
        print(line, file=sys.stderr, flush=True)
        return status
    write_error_file(line)
    if os.environ.get("LOCAL_RANK", "0") != "0":
        wait_for_the_agent(grace_s)  # returns only if no SIGTERM came
    else:
        wait_for_the_others(grace_s)
    print(line, file=sys.stderr, flush=True)
    return status


def write_error_file(line: str) -> None:
    """`line` into torchrun's error file for this worker (if torchrun gave one), as the failure's
    message and "traceback", which its ChildFailedError summary prints."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # a file already there is an earlier, truer record
        return
    data = {
        "message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the line is still printed or the summary names the exit status


def wait_for_the_others(grace_s: float) -> None:
    """Local rank 0: sleep until the node's other workers have written their error files (torchrun's
    layout: .../attempt_<n>/<local rank>/error.json), at most `grace_s` seconds; at once where the
    layout is not that."""
    own = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", ""))
    if own.parent.name != "0":
        return
    others = [
        own.parent.parent / str(k) / own.name for k in range(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    ]
    deadline = time.monotonic() + grace_s
    while not all(p.exists() for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_for_the_agent(grace_s: float) -> None:
    """Sleep up to `grace_s` seconds; on SIGTERM (the agent stopping the group because another worker
    failed) exit 0 at once, so that this worker is not listed as a failure of its own."""

    def stopped(signum: int, frame: FrameType | None) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        time.sleep(grace_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
