"""Clocks for the pipeline executor: host timestamps on a CPU, CUDA events on a GPU.

A GPU runs the work a host thread launches asynchronously, so host timestamps
of launches measure the host, not the device (a one-stage GPU run once logged a
bubble of 0.0007 while the device idled most of the step). On CUDA the executor
therefore records an event on the compute stream after every action; events
cost a launch each and are read once, when a step's timing is resolved (one
synchronisation, at a logged step), never inside a flush. Megatron's timers
work the same way.

    marks   m0  |  F0.0  |  m1  |  SF0.0 RB0.0  |  m2  |  B0.0  |  m3 ...
    spans   (action, start mark, end mark): action i runs between mark i and i + 1

What a device span measures: the time between the stream reaching the event
before the action and the one after it, which includes any wait for the host to
launch the action's kernels; idle time *between* actions (waiting for a peer,
or for the host to reach the next action) is what the bubble counts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class Clock(Protocol):
    def mark(self) -> Any:
        """A timestamp of the point the (host or device) timeline has reached."""
        ...

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        """Each mark's time in seconds after `marks[0]` (may wait for the device)."""
        ...


class HostClock:
    """`time.perf_counter` timestamps: exact for CPU work, which runs as it is launched."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        return [float(m) - float(marks[0]) for m in marks]


class DeviceClock:
    """CUDA events recorded on the current stream; resolved by waiting for the last one."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        marks[-1].synchronize()
        return [marks[0].elapsed_time(m) / 1e3 for m in marks]


def clock_for(device: torch.device) -> Clock:
    """Device events on CUDA, host timestamps elsewhere."""
    return DeviceClock() if device.type == "cuda" else HostClock()
