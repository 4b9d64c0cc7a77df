"""Graceful drain of the coordinator (SIGTERM): stop admitting, finish what runs.

:func:`drain` turns health NOT_SERVING and makes new requests fail at admission (gRPC
UNAVAILABLE, HTTP 503, "the coordinator is draining"), then waits until the scheduler holds no
request or ``timeout`` passes. The caller then stops the server: the scheduler's stop fails
what is left with UNAVAILABLE "the coordinator is shutting down" and frees its KV pages.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.serving.server import CoordinatorServer

POLL_S = 0.05


async def drain(coord: CoordinatorServer, timeout: float) -> int:
    """Returns how many requests were still waiting or running when ``timeout`` passed."""
    coord.draining = True
    coord.experts_ready = False  # NOTE: the admission check of gRPC and HTTP alike
    await coord.set_health()  # NOT_SERVING: draining
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        st = coord.scheduler.stats()
        busy = st["running"] + st["waiting"]
        if not busy or loop.time() >= deadline:
            return busy
        await asyncio.sleep(POLL_S)
