"""Progress of a long weight load: a bar on a terminal, periodic log lines anywhere else.

A 60 GB checkpoint takes minutes to read; without this a starting server looks hung. The
counters are tensors and bytes read (with the rate); ``total_bytes`` when known gives a
percentage and an estimate of the time left.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("expertmesh.load")

_GB = 1 << 30


class LoadProgress:
    """Counts what a load has read; draws a bar on a terminal (at most ~10 redraws/s) or logs a
    line every ``log_every_s`` seconds otherwise, and one closing line either way."""

    def __init__(
        self,
        label: str,
        total_bytes: int = 0,
        stream: TextIO | None = None,
        log_every_s: float = 10.0,
    ) -> None:
        self.label, self.total_bytes = label, total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every_s = log_every_s
        self.tensors = self.bytes = 0
        self.start = self._last = time.monotonic()

    def add(self, nbytes: int, tensors: int = 1) -> None:
        self.tensors += tensors
        self.bytes += nbytes
        now = time.monotonic()
        if now - self._last >= (0.1 if self.tty else self.log_every_s):
            self._last = now
            self._report(now)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.start, 1e-9)
        rate = self.bytes / elapsed
        text = f"{self.label}: {self.tensors} tensors, {self.bytes / _GB:.2f} GiB"
        if self.total_bytes:
            frac = min(self.bytes / self.total_bytes, 1.0)
            left = (self.total_bytes - self.bytes) / rate if rate > 0 else float("inf")
            text += f" of {self.total_bytes / _GB:.2f} GiB ({frac:.0%}), ~{left:.0f}s left"
        return text + f", {rate / (1 << 20):.0f} MiB/s"

    def _report(self, now: float) -> None:
        if not self.tty:
            log.info("%s", self.line(now))
            return
        bar = ""
        if self.total_bytes:
            width = 30
            done = int(width * min(self.bytes / self.total_bytes, 1.0))
            bar = "[" + "#" * done + "." * (width - done) + "] "
        self.stream.write("\r" + bar + self.line(now) + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        now = time.monotonic()
        if self.tty:
            self._report(now)
            self.stream.write("\n")
            self.stream.flush()
        log.info("%s (done in %.1fs)", self.line(now), now - self.start)
