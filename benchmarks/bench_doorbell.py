"""How a small descriptor should cross from the coordinator to an expert server and back when
the payload itself already sits in shared memory: ping-pong between two processes.

    python benchmarks/bench_doorbell.py [--reps 3000] [--spin-us 20]

Options: a futex word in the shared segment (ctypes syscall; with and without a short spin
before sleeping), a pipe, a Unix socket carrying the descriptor, an eventfd, the descriptor
inside a gRPC message on a bidirectional stream (grpcio, as the data path uses it), and the
design expertmesh.transport uses: the descriptor through a pipe plus a counter in the segment
that the waiter polls for a while (yielding the CPU) before it sleeps. Prints the median and
p90 round trip in microseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DESC = b"d" * 64
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long
_LIBC.syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p]


class Word:
    """A 32-bit counter in a shared mapping used as a futex doorbell (one writer per word)."""

    def __init__(self, buf, offset: int) -> None:
        self.cell = ctypes.c_uint32.from_buffer(buf, offset)
        self.addr = ctypes.addressof(self.cell)
        self.ts = (ctypes.c_long * 2)(1, 0)  # 1 s: the waiter re-checks and sleeps again

    def post(self, value: int) -> None:
        self.cell.value = value
        _LIBC.syscall(_SYS_FUTEX, self.addr, 1, 1 << 30, None)  # FUTEX_WAKE

    def wait_change(self, seen: int, spin_s: float) -> int:
        if spin_s:
            end = time.perf_counter() + spin_s
            while time.perf_counter() < end:
                if self.cell.value != seen:
                    return self.cell.value
        while self.cell.value == seen:
            _LIBC.syscall(_SYS_FUTEX, self.addr, 0, seen, ctypes.addressof(self.ts))  # FUTEX_WAIT
        return self.cell.value


def _stats(ts: list[float]) -> tuple[float, float]:
    ts = sorted(ts)
    return statistics.median(ts) * 1e6, ts[int(0.9 * len(ts))] * 1e6


def _fork(child) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(0)
    return pid


def bench_futex(reps: int, spin_s: float) -> list[float]:
    mm = mmap.mmap(-1, 4096)  # anonymous shared mapping, inherited by the fork
    req, resp = Word(mm, 0), Word(mm, 64)

    def child() -> None:
        seen = 0
        for i in range(1, reps + 1):
            seen = req.wait_change(seen, spin_s)
            mm[128:192] = mm[256:320]  # "read the descriptor, write the answer"
            resp.post(i)

    pid = _fork(child)
    ts, seen = [], 0
    for i in range(1, reps + 1):
        t0 = time.perf_counter()
        mm[256:320] = DESC
        req.post(i)
        seen = resp.wait_change(seen, spin_s)
        ts.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
    return ts


def bench_fd_pair(reps: int, kind: str) -> list[float]:
    if kind == "pipe":
        a_r, a_w = os.pipe()
        b_r, b_w = os.pipe()
        send = lambda fd, b: os.write(fd, b)  # noqa: E731
        recv = lambda fd: os.read(fd, 4096)  # noqa: E731
        to_child, from_child = (a_w, b_r), (a_r, b_w)
    elif kind == "eventfd":
        ea, eb = os.eventfd(0), os.eventfd(0)
        send = lambda fd, b: os.eventfd_write(fd, 1)  # noqa: E731
        recv = lambda fd: os.eventfd_read(fd)  # noqa: E731
        to_child, from_child = (ea, eb), (ea, eb)
    else:
        s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        send = lambda s, b: s.send(b)  # noqa: E731
        recv = lambda s: s.recv(4096)  # noqa: E731
        to_child, from_child = (s1, s1), (s2, s2)

    def child() -> None:
        rd, wr = from_child
        for _ in range(reps):
            d = recv(rd)
            send(wr, d if isinstance(d, bytes) else DESC)

    pid = _fork(child)
    wr, rd = to_child
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        send(wr, DESC)
        recv(rd)
        ts.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
    return ts


def bench_pipe_spin(reps: int, spin_us: float) -> list[float]:
    """The chosen design: the 256-byte descriptor through a pipe, and a counter in the segment
    that the waiter polls (yielding the CPU) for up to ``spin_us`` before it sleeps in read."""
    from expertmesh.transport.spin import Spin

    mm = mmap.mmap(-1, 4096)
    words = np.frombuffer(mm, dtype=np.uint32)
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    desc = DESC * 4

    def wait(fd: int, word: int, seen: int, spin: Spin) -> None:
        if not spin.until(lambda: words[word] != seen):
            t0 = time.monotonic()
            os.read(fd, 256)
            spin.blocked_for(time.monotonic() - t0)
            return
        os.read(fd, 256)

    def child() -> None:
        spin = Spin(spin_us)
        for i in range(1, reps + 1):
            wait(a_r, 0, (i - 1) & 0xFFFFFFFF, spin)
            os.write(b_w, desc)
            words[16] = i

    pid = _fork(child)
    spin = Spin(spin_us)
    ts = []
    for i in range(1, reps + 1):
        t0 = time.perf_counter()
        os.write(a_w, desc)
        words[0] = i
        wait(b_r, 16, (i - 1) & 0xFFFFFFFF, spin)
        ts.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
    return ts


def _echo_server() -> None:
    import asyncio

    import grpc

    async def echo(it, ctx):
        async for m in it:
            yield m

    async def main() -> None:
        s = grpc.aio.server()
        h = grpc.stream_stream_rpc_method_handler(echo)
        s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Ping": h}),))
        port = s.add_insecure_port("127.0.0.1:0")
        await s.start()
        print(port, flush=True)
        await s.wait_for_termination()

    asyncio.run(main())


def bench_grpc(reps: int) -> list[float]:
    import grpc

    p = subprocess.Popen([sys.executable, __file__, "_echo"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        port = int(p.stdout.readline())
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        q: queue.Queue = queue.Queue()
        call = ch.stream_stream("/bench.Echo/Ping")(iter(q.get, None))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            q.put(DESC)
            next(call)
            ts.append(time.perf_counter() - t0)
        q.put(None)
        ch.close()
        return ts
    finally:
        p.kill()
        p.wait()


def main() -> None:
    if sys.argv[1:] == ["_echo"]:
        return _echo_server()
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--spin-us", type=float, default=20.0)
    ap.add_argument("--pipe-spin-us", type=float, default=300.0, help="the transport's default spin")
    ap.add_argument("--repeat", type=int, default=3, help="runs per option; the median run is shown")
    args = ap.parse_args()
    options = {
        "futex word in the segment": lambda: bench_futex(args.reps, 0.0),
        f"futex word, spin {args.spin_us:g} us first": lambda: bench_futex(args.reps, args.spin_us * 1e-6),
        "pipe (1 byte each way)": lambda: bench_fd_pair(args.reps, "pipe"),
        "eventfd": lambda: bench_fd_pair(args.reps, "eventfd"),
        "unix socket (descriptor in it)": lambda: bench_fd_pair(args.reps, "socket"),
        f"pipe + counter, spin {args.pipe_spin_us:g} us (chosen)": lambda: bench_pipe_spin(
            args.reps, args.pipe_spin_us
        ),
        "gRPC stream (descriptor in message)": lambda: bench_grpc(args.reps),
    }
    print(f"# ping-pong of a 64-byte descriptor between two processes, {args.reps} round trips per run")
    print(f"| {'option':<40} | median us | p90 us |")
    print(f"|{'-' * 42}|-----------|--------|")
    for name, fn in options.items():
        runs = sorted((_stats(fn()) for _ in range(args.repeat)), key=lambda r: r[0])
        med, p90 = runs[len(runs) // 2]
        print(f"| {name:<40} | {med:>9.1f} | {p90:>6.1f} |", flush=True)


if __name__ == "__main__":
    main()
