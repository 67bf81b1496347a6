"""A rank that stalls mid-flush: its neighbour says who waited for what, first in a warning,
then in the timeout error.

The story: a pp neighbour stopped with SIGSTOP under `--dist_timeout_s 30` used to
end the run with gloo's bare "Timed out waiting 30000ms for recv operation to
complete": no rank, no coordinates, no action. Now every blocking wait is recorded
(host-only) and the error is a CommWaitError naming the waiting rank, its (pp, dp,
tp) coordinates and the awaited transfer, raised from gloo's error; the watchdog
thread warns with the same words while the wait is still going.

Two gloo ranks, pp=2, 1F1B with m=2, collective timeout 3 s: after one normal
step the last stage sleeps 6 s inside micro-batch 1's forward, so pp rank 0 waits
at RB0.1 for micro-batch 1's input gradients.
"""

from __future__ import annotations

import pytest

from tests.dist.fault_workers import stalled_flush
from tests.dist.harness import run_distributed

TIMEOUT_S, STALL_S, WARN_AFTER_S = 3, 6.0, 1.0


@pytest.mark.dist
def test_stalled_neighbour_is_named_in_warning_and_timeout_error() -> None:
    first, _ = run_distributed(
        stalled_flush, 2, args=(STALL_S, WARN_AFTER_S), timeout=120, collective_timeout=TIMEOUT_S
    )
    what = "the input gradients of micro-batch 1 for stage 0 (RB0.1) from pp rank 1 (global rank 1)"
    me = "pp rank 0 (pp=0 dp=0 tp=0, global rank 0)"
    assert first["error_type"] == "CommWaitError", first
    assert first["error"].startswith(f"{me} waited "), first["error"]
    assert f"for {what}, then failed: " in first["error"], first["error"]
    assert "Timed out" in first["error"] and first["cause"] in ("RuntimeError", "DistBackendError"), first
    # Gave up at the collective timeout, not at the end of the stall.
    assert TIMEOUT_S - 0.5 <= first["error_at"] < STALL_S, first
    warnings = [(t, msg) for t, msg in first["warnings"] if what in msg]
    assert len(warnings) == 1, first["warnings"]
    t, msg = warnings[0]
    assert msg.startswith(f"{me} has waited "), msg
    assert WARN_AFTER_S <= t < first["error_at"], (t, first["error_at"])
