"""The delay proxy's C data path (delay_proxy.c), built on first use through
:mod:`expertmesh.cbuild` and driven through ctypes: its threads are pthreads that never take
the GIL, so the proxy's own cost per chunk is a few system calls, not Python.

:class:`DelayProxy <expertmesh.transport.delay_proxy.DelayProxy>` uses it where it builds and
falls back to the Python threads otherwise (:func:`unavailable` says why).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import threading
from pathlib import Path

from expertmesh.cbuild import CachedLibrary

log = logging.getLogger("expertmesh.transport")

SOURCES = (Path(__file__).with_name("delay_proxy.c"),)
FLAGS = ["-O2", "-fPIC", "-shared", "-pthread"]
# dproxy_stats() slots (delay_proxy.c ST_*): chunks and bytes sent; ns each chunk went out after
# its due time (sum, max) and chunks 20 us or more late; ns from the kernel's receive stamp to
# the read (sum, max); reads that carried the stamp; reads
STATS = (
    "chunks",
    "bytes",
    "late_ns_sum",
    "late_ns_max",
    "late",
    "lag_ns_sum",
    "lag_ns_max",
    "stamped",
    "reads",
)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dproxy_start.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        i64,
        i64,
        i64,
        ctypes.c_uint64,
    ]
    lib.dproxy_start.restype = p
    lib.dproxy_connections.argtypes = [p]
    lib.dproxy_connections.restype = i64
    lib.dproxy_stats.argtypes = [p, p]
    lib.dproxy_stats.restype = None
    lib.dproxy_stop.argtypes = [p, p]
    lib.dproxy_stop.restype = None


_LIB = CachedLibrary("the C delay proxy", "delay_proxy", SOURCES, FLAGS, _declare, use_errno=True)
build, load, unavailable = _LIB.build, _LIB.load, _LIB.unavailable


class CProxy:
    """The C threads forwarding the connections ``listener`` accepts to ``port`` at the first
    of ``hosts`` (IP addresses, already checked to be loopback) that takes the connection.
    ``listener`` stays the caller's: close it after :meth:`close`."""

    def __init__(
        self, listener: socket.socket, hosts: list[str], port: int, delay_us: float, jitter_us: float,
        spin_us: float, seed: int,
    ) -> None:  # fmt: skip
        self._h: int | None = None
        self._final: dict[str, int] = dict.fromkeys((*STATS, "connections"), 0)
        self._lock = threading.Lock()
        lib = load()
        if lib is None:
            raise OSError(unavailable())
        self._lib = lib
        ns = [round(v * 1e3) for v in (delay_us, jitter_us, spin_us)]
        handle = lib.dproxy_start(
            listener.fileno(), ",".join(hosts[:8]).encode(), port, *ns, seed & (2**64 - 1)
        )
        if not handle:
            err = ctypes.get_errno() or errno.EINVAL
            raise OSError(err, f"the C delay proxy did not start for {hosts} port {port}: {os.strerror(err)}")
        self._h = handle
        # NOTE: held so that the listening socket cannot close (and its descriptor be reused)
        # under the accept thread before close() has stopped it
        self._listener = listener

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        with self._lock:
            return (
                self._final["connections"] if self._h is None else int(self._lib.dproxy_connections(self._h))
            )

    def stats(self) -> dict[str, int]:
        """The counters of :data:`STATS` and ``connections``, so far (after :meth:`close`: final)."""
        with self._lock:
            if self._h is None:
                return dict(self._final)
            out = (ctypes.c_int64 * len(STATS))()
            self._lib.dproxy_stats(self._h, out)
            return {
                **dict(zip(STATS, out, strict=True)),
                "connections": int(self._lib.dproxy_connections(self._h)),
            }

    def __del__(self) -> None:
        if getattr(self, "_h", None) is not None:  # never started: nothing to stop
            self.close()

    def close(self) -> None:
        """Stops accepting, closes every connection and waits for the C threads to end."""
        with self._lock:  # NOTE: held while the threads end: no stats() reads a freed proxy
            if self._h is None:
                return
            final = (ctypes.c_int64 * (len(STATS) + 1))()
            self._lib.dproxy_stop(self._h, final)
            self._final = {
                **dict(zip(STATS, final[: len(STATS)], strict=True)),
                "connections": final[len(STATS)],
            }
            self._h = None
