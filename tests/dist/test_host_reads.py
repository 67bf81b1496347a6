"""The hot path never waits on the device: no device-to-host read inside a step's flushes,
nor in the global grad norm and clip, on any mesh or schedule.

Counted on CPU (gloo) with a dispatch mode (`parallel.dispatch_count`): a read there is
free, but the same code on a GPU would stop the host from launching the next
micro-batch until the device caught up (the issue measured ~5 reads per micro-batch).
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_distributed
from tests.dist.pipeline_workers import host_reads_in_step

MESHES = [
    (1, 4, 1, "1f1b", False),
    (2, 2, 1, "1f1b", False),
    (2, 2, 1, "zero_bubble", False),
    (2, 1, 2, "zbv", False),
    (2, 1, 2, "interleaved_1f1b", False),
    (2, 1, 2, "gpipe", True),
    (1, 2, 2, "1f1b", True),
]


@pytest.mark.dist
def test_no_host_reads_in_a_training_step() -> None:
    for rank, rows in enumerate(run_distributed(host_reads_in_step, 4, args=(MESHES,), timeout=240)):
        for pp, dp, tp, schedule, sp, reads, ops in rows:
            assert ops > 0
            assert reads == 0, (
                f"rank {rank}, pp={pp} dp={dp} tp={tp} {schedule} sp={sp}: {reads} device-to-host reads in a step"
            )
