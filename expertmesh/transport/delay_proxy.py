"""A loopback TCP proxy that adds a fixed one-way delay (and optional jitter), so that a data
path can be measured as if its server were a network hop away on a machine with one host and
no netem.

    python -m expertmesh.transport.delay_proxy --listen 127.0.0.1:7001 --to 127.0.0.1:7000 \\
        --delay-us 100 [--jitter-us 20]

Every byte read from one side is written to the other ``delay`` (+ a uniform draw in
``[-jitter, +jitter]``) after it arrived (C: when the kernel received it; Python: when the
reader thread read it), in order: a chunk never overtakes the one before it
(TCP would see its stream corrupted), so jitter only ever delays. Both ways, any number of
connections. Only loopback addresses are accepted, on both ends.

Two implementations of the data path (``impl``, ``--impl``):
- ``c`` (the default where a C compiler builds it, :mod:`.delay_proxy_c`): one pthread per
  connection and direction reads, stamps each chunk with the time the kernel received it, and
  sends it when due, busy-polling for ``spin_us`` around each wait; no GIL, no thread hand-over.
- ``python`` (the fallback): per direction a reader thread and a writer thread handing chunks
  over; the writer sleeps until shortly before its chunk is due and polls for the last
  ``spin_us``. Its own cost (two thread wake-ups per direction under the GIL) comes on top of
  the delay, tens of microseconds and more on a loaded machine.

Measure the proxy's own cost with ``--delay-us 0`` beside the direct path
(benchmarks/bench_delay_proxy.py). On SIGTERM/SIGINT the CLI closes every connection and
prints one line of counters (C: how late after their due time chunks went out).

For the TCP data path, run one proxy in front of the expert server's data port and give the
coordinator ``--server-data-address SERVER=127.0.0.1:PROXY_PORT`` (a second one in front of the
gRPC port delays the control plane as well).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import random
import signal
import socket
import threading
import time
from collections import deque
from typing import Literal

from expertmesh.transport import delay_proxy_c
from expertmesh.transport.tcp import split_address

CHUNK = 1 << 16
IMPLS = ("auto", "c", "python")


def check_loopback(host: str, what: str) -> None:
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise ValueError(f"{what} {host!r}: {e}") from None
    for info in infos:
        if not ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback:
            raise ValueError(f"{what} {host!r} is not a loopback address: this proxy stays on one host")


class _Direction:
    """One way of one connection: a reader stamping chunks, a writer releasing them when due."""

    def __init__(self, proxy: DelayProxy, src: socket.socket, dst: socket.socket, closer) -> None:
        self.proxy, self.src, self.dst, self.closer = proxy, src, dst, closer
        self.queue: deque[tuple[float, bytes]] = deque()
        self.cv = threading.Condition()
        self.last = 0.0  # release time of the previous chunk (no overtaking)
        for target, name in ((self._read, "delay-read"), (self._write, "delay-write")):
            threading.Thread(target=target, daemon=True, name=name).start()

    def _read(self) -> None:
        p = self.proxy
        while True:
            try:
                data = self.src.recv(CHUNK)
            except OSError:
                data = b""
            now = time.perf_counter()
            jitter = p.rng.uniform(-p.jitter_s, p.jitter_s) if p.jitter_s else 0.0
            due = max(self.last, now + max(0.0, p.delay_s + jitter))
            self.last = due
            with self.cv:
                self.queue.append((due, data))  # b"": end of stream, passed on when due
                self.cv.notify()
            if not data:
                return

    def _write(self) -> None:
        spin = self.proxy.spin_s
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                due, data = self.queue.popleft()
            left = due - time.perf_counter()
            if left > spin:
                time.sleep(left - spin)
            while time.perf_counter() < due:
                pass  # NOTE: the last few microseconds: a sleep would overshoot them
            if not data:
                with contextlib.suppress(OSError):
                    self.dst.shutdown(socket.SHUT_WR)
                self.closer()
                return
            try:
                self.dst.sendall(data)
            except OSError:
                self.closer(force=True)
                return


class DelayProxy:
    """Forwards ``listen`` -> ``to`` with ``delay_us`` added each way (see the module text).
    ``impl``: ``"c"``, ``"python"`` or ``"auto"`` (C where it builds); :attr:`impl` says which
    runs."""

    def __init__(
        self,
        to: tuple[str, int],
        listen: tuple[str, int] = ("127.0.0.1", 0),
        delay_us: float = 100.0,
        jitter_us: float = 0.0,
        spin_us: float = 100.0,
        seed: int | None = None,
        impl: Literal["auto", "c", "python"] = "auto",
    ) -> None:
        if delay_us < 0 or jitter_us < 0 or spin_us < 0:
            raise ValueError("--delay-us, --jitter-us and --spin-us must be >= 0")
        if impl not in IMPLS:
            raise ValueError(f"impl {impl!r}: one of {', '.join(IMPLS)}")
        check_loopback(listen[0], "--listen")
        check_loopback(to[0], "--to")
        if impl == "c" and delay_proxy_c.unavailable():
            raise ValueError(delay_proxy_c.unavailable())
        self.impl = "c" if impl != "python" and not delay_proxy_c.unavailable() else "python"
        self.to = to
        self.delay_s, self.jitter_s, self.spin_s = delay_us * 1e-6, jitter_us * 1e-6, spin_us * 1e-6
        self.rng = random.Random(seed)
        self._sock = socket.create_server(
            listen, family=socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        )
        self.port: int = self._sock.getsockname()[1]
        self.address = f"{listen[0]}:{self.port}"
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._accepted = 0
        self._lock = threading.Lock()
        self._c: delay_proxy_c.CProxy | None = None
        if self.impl == "c":
            # NOTE: the C side takes IP addresses, tried in the resolver's order as a connect would
            infos = socket.getaddrinfo(to[0], to[1], type=socket.SOCK_STREAM)
            ips = list(dict.fromkeys(str(i[4][0]).split("%")[0] for i in infos))
            try:
                self._c = delay_proxy_c.CProxy(
                    self._sock, ips, to[1], delay_us, jitter_us, spin_us, self.rng.getrandbits(64)
                )
            except OSError:
                self._sock.close()
                raise
        else:
            threading.Thread(target=self._accept, daemon=True, name="delay-proxy").start()

    @property
    def connections(self) -> int:
        """Connections accepted so far."""
        return self._c.connections if self._c is not None else self._accepted

    def stats(self) -> dict[str, int]:
        """``connections``, and with the C data path its counters (delay_proxy_c.STATS: chunks
        and bytes sent, how late after their due time, how long after the kernel received
        them they were read); final after :meth:`close`."""
        return self._c.stats() if self._c is not None else {"connections": self._accepted}

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        if self._c is not None:
            self._c.close()  # its threads are gone before the listening socket closes
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                a, _ = self._sock.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.to, timeout=10)
            except OSError:
                a.close()
                continue
            b.settimeout(None)
            for s in (a, b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.update((a, b))
                self._accepted += 1
            self._pair(a, b)

    def _pair(self, a: socket.socket, b: socket.socket) -> None:
        ended = [0]
        lock = threading.Lock()

        def closer(force: bool = False) -> None:
            with lock:
                ended[0] = 2 if force else ended[0] + 1
                done = ended[0] >= 2
            if done:  # both ways ended (or one failed): the connection goes
                with self._lock:
                    self._conns.difference_update((a, b))
                for s in (a, b):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
                    s.close()

        _Direction(self, a, b, closer)
        _Direction(self, b, a, closer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m expertmesh.transport.delay_proxy", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--listen",
        required=True,
        metavar="HOST:PORT",
        help="loopback address to listen on (port 0: a free one)",
    )
    ap.add_argument("--to", required=True, metavar="HOST:PORT", help="loopback address to forward to")
    ap.add_argument("--delay-us", type=float, default=100.0, help="added one-way delay, microseconds")
    ap.add_argument(
        "--jitter-us", type=float, default=0.0, help="uniform jitter around the delay (never reorders)"
    )
    ap.add_argument(
        "--spin-us",
        type=float,
        default=100.0,
        help="busy-poll this long before a chunk is due (and, C, after the last byte moved); 0 = sleep only",
    )
    ap.add_argument(
        "--impl", choices=IMPLS, default="auto", help="data path: C (auto: where it builds) or Python threads"
    )
    args = ap.parse_args(argv)
    host, port = args.listen.rpartition(":")[0].strip("[]"), int(args.listen.rpartition(":")[2])
    try:
        proxy = DelayProxy(
            split_address(args.to), (host, port), args.delay_us, args.jitter_us, args.spin_us, impl=args.impl
        )
    except (ValueError, OSError) as e:
        ap.error(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"delay proxy listening on {proxy.address} -> {args.to} (+{args.delay_us:g} us each way, {proxy.impl})",
        flush=True,
    )
    stop.wait()
    proxy.close()
    print(summary(proxy.stats()), flush=True)
    return 0


def summary(st: dict[str, int]) -> str:
    """One line of the proxy's counters (DelayProxy.stats)."""
    line = f"delay proxy stopped: {st['connections']} connections"
    if "chunks" in st:
        n, reads = max(1, st["chunks"]), max(1, st["reads"])
        line += (
            f", {st['chunks']} chunks ({st['bytes']} bytes) sent {st['late_ns_sum'] / n / 1e3:.1f} us after"
            f" due on average (max {st['late_ns_max'] / 1e3:.1f}, {st['late']} >= 20 us late), read"
            f" {st['lag_ns_sum'] / reads / 1e3:.1f} us after arrival on average (max {st['lag_ns_max'] / 1e3:.1f};"
            f" {st['stamped']} of {st['reads']} reads stamped by the kernel)"
        )
    return line


if __name__ == "__main__":
    raise SystemExit(main())
