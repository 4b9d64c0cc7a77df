"""Bounded, adaptive spinning before a blocking wait.

Why: on the machines this runs on (small VMs), waking a process that sleeps in a pipe read on
another CPU costs tens of microseconds (an inter-processor interrupt through the hypervisor),
as much as the rest of a fast-path round trip. A waiter that expects its answer soon instead
polls a counter in the shared segment for a while, yielding the CPU between looks, and only
then sleeps; a writer whose reader is not asleep pays no wake-up at all.

The budget adapts: a spin that ends without the event halves it (down to nothing, so an idle
or slow peer costs no CPU); a blocking wait that ended within the full budget restores it
(spinning would have caught that one).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


class Spin:
    def __init__(self, max_us: float) -> None:
        self.max_s = max(0.0, max_us) * 1e-6
        self.budget_s = self.max_s

    def until(self, happened: Callable[[], bool]) -> bool:
        """Spins until ``happened()`` or the budget is spent; True if it happened."""
        if self.budget_s <= 0:
            return happened()
        clock = time.perf_counter
        end = clock() + self.budget_s
        while not happened():
            if clock() > end:
                self.budget_s = self.budget_s / 2 if self.budget_s > self.max_s / 16 else 0.0
                return False
            os.sched_yield()  # NOTE: releases the GIL and lets anything runnable here go first
        return True

    def blocked_for(self, seconds: float) -> None:
        """Reports how long the blocking wait after a failed spin took."""
        if seconds < self.max_s:
            self.budget_s = self.max_s
