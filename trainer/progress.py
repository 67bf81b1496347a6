"""Progress of long work, for every command: a tqdm bar on stderr, or log lines where bars are off.

    Progress(total, desc, unit, bar=...)   work counted toward a known total
        bar=True    a tqdm bar on stderr (count, rate, ETA); `TQDM_DISABLE=1` in the environment
                    turns every bar into lines
        bar=False   lines through `logger`, so a SLURM log shows them: one every `every_s`
                    seconds (count, elapsed, ETA) and, after such a line, one when the work ends
        enabled=False   nothing (the ranks that do not log)

    format_duration(seconds) -> "1:02:03";  format_bytes(n) -> "1.50GB" (powers of 1024)

The trainer shows bars unless `disable_tqdm` is set; export, translate and plan show bars
(their bars go to stderr, so `translate`'s stdout holds only translations).
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any

from tqdm.auto import tqdm

PROGRESS_LOGGER = "trainer.progress"  # the logging rank sets it to INFO (trainer.run.setup)


def format_duration(seconds: float) -> str:
    """`h:mm:ss` of a non-negative duration (tqdm's ETA format, hours always shown)."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_bytes(n: float) -> str:
    """`n` bytes as tqdm shows them (powers of 1024: `931kB`, `1.50GB`)."""
    return str(tqdm.format_sizeof(n, "B", 1024))


class Progress:
    """Work counted toward a known `total` (see the module docstring).

    Args:
        total: units of work in all.
        desc: what the work is ("eval translate step 200", "export").
        unit: what one unit is ("batch", "line", "B": bytes, shown scaled).
        enabled: False on ranks that show nothing.
        bar: a tqdm bar (True) or log lines (False).
        logger: where lines go (`PROGRESS_LOGGER` by default).
        every_s: seconds between lines.
        leave: keep the bar on screen when it closes (tqdm's `leave`).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "it",
        enabled: bool = True,
        bar: bool = True,
        logger: logging.Logger | None = None,
        every_s: float = 30.0,
        leave: bool = True,
    ) -> None:
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.logger = logger or logging.getLogger(PROGRESS_LOGGER)
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self.t0 = self._last = time.perf_counter()
        self._lines_shown = 0
        self.bar: Any = None
        self.lines = False
        if not enabled:
            return
        if bar:
            scale = unit == "B"
            self.bar = tqdm(
                total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
                leave=leave, dynamic_ncols=True, file=sys.stderr,
            )  # fmt: skip
            if self.bar.disable:  # TQDM_DISABLE=1
                self.bar = None
        self.lines = self.bar is None

    def update(self, n: int = 1, **postfix: Any) -> None:
        """`n` more units done; `postfix` (e.g. direction="en-de") is shown beside the count."""
        self.n += n
        if postfix:
            self.postfix = postfix
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
        elif self.lines and time.perf_counter() - self._last >= self.every_s:
            self._line()

    def _line(self) -> None:
        now = time.perf_counter()
        self._last = now
        self._lines_shown += 1
        elapsed = now - self.t0
        if self.unit == "B":
            done = f"{format_bytes(self.n)}/{format_bytes(self.total)}"
        else:
            done = f"{self.n}/{self.total} {self.unit}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        eta = ""
        if 0 < self.n < self.total:
            eta = f", eta {format_duration(elapsed / self.n * (self.total - self.n))}"
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        self.logger.info(
            "%s: %s%s, %s elapsed%s%s", self.desc, done, pct, format_duration(elapsed), eta, extra
        )

    def close(self) -> None:
        """Close the bar; in lines mode, a last line where the work outlasted `every_s`."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.lines and self._lines_shown:
            self._line()
        self.lines = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
