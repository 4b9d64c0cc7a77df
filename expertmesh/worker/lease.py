"""The placement lease an expert server grants: at most one coordinator at a time holds it,
until it expires or is released; the holder renews it. Coordinators sharing the servers
(coordinator/experts/pool.py) take the placement role from it, and a server refuses placement
pushes from anyone else while it is held (fencing: a coordinator that lost the role cannot push
a late placement). No gRPC here; the clock is injectable for the tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_TTL_S = 300.0  # a dead holder blocks placement changes at most this long


@dataclass(frozen=True)
class LeaseState:
    granted: bool  # the asker holds the lease now
    holder: str  # "" = nobody
    left_s: float  # until it expires (0 when nobody holds it)


class PlacementLease:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._holder = ""
        self._until = 0.0
        self._lock = threading.Lock()  # the event loop and the loader thread both ask

    def _live(self, now: float) -> str:
        return self._holder if self._holder and now < self._until else ""

    def acquire(self, holder: str, ttl_s: float) -> LeaseState:
        """Grants or renews the lease for ``ttl_s`` seconds when nobody else holds it."""
        if not holder:
            raise ValueError("a lease holder needs a non-empty id")
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"lease ttl {ttl_s:g}s outside (0, {MAX_TTL_S:g}]")
        with self._lock:
            now = self._clock()
            current = self._live(now)
            if current and current != holder:
                return LeaseState(False, current, self._until - now)
            self._holder, self._until = holder, now + ttl_s
            return LeaseState(True, holder, ttl_s)

    def release(self, holder: str) -> LeaseState:
        """Gives the lease up if ``holder`` holds it (a no-op otherwise)."""
        with self._lock:
            now = self._clock()
            if self._live(now) == holder:
                self._holder, self._until = "", 0.0
            return self._state(holder, now)

    def observe(self, holder: str = "") -> LeaseState:
        with self._lock:
            return self._state(holder, self._clock())

    def _state(self, holder: str, now: float) -> LeaseState:
        current = self._live(now)
        return LeaseState(bool(current) and current == holder, current, self._until - now if current else 0.0)

    def may_push(self, holder: str) -> str:
        """ "" when a placement push from ``holder`` is allowed (nobody else holds the lease),
        else the live holder's id."""
        with self._lock:
            current = self._live(self._clock())
            return current if current and current != holder else ""
