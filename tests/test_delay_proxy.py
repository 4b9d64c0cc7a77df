"""The loopback latency proxy: adds the one-way delay it claims (a measured round trip through
it, against the direct one), keeps the byte stream intact under jitter, refuses non-loopback
addresses."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

from expertmesh.transport.delay_proxy import DelayProxy
from tests.cluster_utils import ROOT


class Echo:
    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c: socket.socket) -> None:
        with c:
            while data := c.recv(65536):
                c.sendall(data)

    def close(self) -> None:
        self.sock.close()


def round_trip_ms(port: int, n: int = 30) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(b"x" * 64)
            got = b""
            while len(got) < 64:
                got += s.recv(64)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def test_the_proxy_adds_the_delay_it_claims():
    echo = Echo()
    try:
        with (
            DelayProxy(("127.0.0.1", echo.port), delay_us=0, spin_us=0) as p0,
            DelayProxy(("127.0.0.1", echo.port), delay_us=3000, spin_us=0) as p3,
        ):
            base = round_trip_ms(p0.port)
            slow = round_trip_ms(p3.port)
        added = slow - base
        # two one-way delays of 3 ms; a loaded 2-core machine may add a little on top
        assert 6.0 <= added < 9.0, (base, slow)
    finally:
        echo.close()


def test_jitter_never_reorders_bytes():
    echo = Echo()
    try:
        with DelayProxy(("127.0.0.1", echo.port), delay_us=200, jitter_us=200, seed=1) as p:
            payload = os.urandom(1 << 20)
            with socket.create_connection(("127.0.0.1", p.port), timeout=30) as s:
                threading.Thread(
                    target=lambda: [s.sendall(payload[i : i + 1000]) for i in range(0, len(payload), 1000)],
                    daemon=True,
                ).start()
                got = b""
                while len(got) < len(payload):
                    chunk = s.recv(1 << 16)
                    assert chunk
                    got += chunk
            assert got == payload
    finally:
        echo.close()


def test_non_loopback_targets_are_refused():
    with pytest.raises(ValueError, match="not a loopback address"):
        DelayProxy(("10.1.2.3", 80))
    with pytest.raises(ValueError, match="not a loopback address"):
        DelayProxy(("127.0.0.1", 80), listen=("0.0.0.0", 0))
    p = subprocess.run(
        [sys.executable, "-m", "expertmesh.transport.delay_proxy", "--listen", "127.0.0.1:0", "--to", "8.8.8.8:53"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2 and "not a loopback address" in p.stderr
