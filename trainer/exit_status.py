"""How an entry point ends on an error it reports in one line (bad input, a divergence, a failed
checkpoint write): the line printed once, the exit status, and, under torchrun, what torchrun shows.

Outside torchrun every process prints its line. Under torchrun (its agent sets TORCHELASTIC_RUN_ID)
a config error is met by every rank alike, and torchrun adds a ChildFailedError summary listing
every worker that exited non-zero (8 lines each) with a link to its docs as the cause. torch 2.13's
agent (`torch/distributed/elastic`) prints that summary, and retries the group up to
`--max-restarts` times, for *any* non-zero exit: no exit status or error-file field makes a failure
final (`errorTraits` "retryability" is written, never read; only a worker stuck in D-state turns
restarts off). What the workers can do, through torchrun's per-worker error files
(TORCHELASTIC_ERROR_FILE, `.../attempt_<n>/<local rank>/error.json`), `fail_in_one_line` does:

    every failing rank    writes its line into its error file as the JSON that
                          `torch.distributed.elastic.multiprocessing.errors.ErrorHandler` writes:
                          the summary then shows the line as the failure's cause
    local rank 0          waits (at most GRACE_S) until the node's other workers have written theirs,
                          so that they are waiting for the agent as below rather than killed on their
                          way there (listed as failures, -15); prints the line; exits with the status
    other local ranks     wait for the agent's SIGTERM, which comes once local rank 0 has exited, and
                          exit 0 on it: the summary lists one failure, not one per rank. They wait while
                          local rank 0's error file says it meets an error too (at most GRACE_S more
                          than it does); without it after GRACE_S, the error is the rank's own: it
                          prints it and exits with the status

torchrun's own exit status is 1 whatever the workers' (it never forwards one). It still prints its
own lines: "Sending process ... closing signal SIGTERM" per other worker, the failure, a note that
it has no error file of its own to copy the cause into, and the ChildFailedError traceback with the
summary. Under `--max-restarts N` all of it comes once per attempt. TRAINER_EXIT_GRACE_S sets
GRACE_S (ranks that reach the error further apart than that, on a loaded host, each print it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

GRACE_S = float(os.environ.get("TRAINER_EXIT_GRACE_S", "30"))


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
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    others = sibling_error_files(local_rank)
    if local_rank == 0:
        wait_until(lambda: all(p.exists() for p in others), grace_s)
    else:
        wait_for_the_agent(others, grace_s)  # returns only if no SIGTERM came
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
        pass  # the line is still printed; the summary then names the exit status only


def sibling_error_files(local_rank: int) -> list[Path]:
    """The other local ranks' error files for local rank 0, local rank 0's for the others ([] where the
    path is not torchrun's `.../attempt_<n>/<local rank>/error.json`)."""
    own = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", ""))
    if own.parent.name != str(local_rank):
        return []
    ranks = range(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if local_rank == 0 else [0]
    return [own.parent.parent / str(k) / own.name for k in ranks]


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `done` every 50 ms for at most `timeout_s` seconds; whether it came true."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for_the_agent(rank0_error: list[Path], grace_s: float) -> None:
    """Wait for the agent's SIGTERM (it stops the group once a worker failed) and exit 0 on it, so that
    this worker is not listed as a failure of its own: for `grace_s` seconds, then as long again once
    local rank 0's error file (`rank0_error`) exists, since local rank 0 then leaves within `grace_s`."""

    def stopped(signum: int, frame: FrameType | None) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        if wait_until(lambda: any(p.exists() for p in rank0_error), grace_s):
            time.sleep(2 * grace_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
