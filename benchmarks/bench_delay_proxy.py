"""The delay proxy's own cost: a ping-pong of one layer's frame at batch 1 (hidden 2048 bf16 =
4 KiB, plus ids, weights and header) between two processes, direct and through
``python -m expertmesh.transport.delay_proxy`` run as its own process (as bench_fullsize
runs it), per implementation, delay and spin.

    python benchmarks/bench_delay_proxy.py [--bytes 4160] [--n 5000] [--repeat 3] \\
        [--rows direct python:0 c:0 c:100 python:100 c:100:20]

A row ``IMPL:DELAY_US[:SPIN_US]`` (spin default: the proxy's, 100 us). The echo runs in its own
process, the client in this one; both are Python (blocking socket calls, TCP_NODELAY), the same
in every row, so that a row minus ``direct`` is what the proxy adds, and that minus twice the
delay is the proxy's own cost. Per row: round trip median and p90 (us) over ``--n`` round
trips, the median of ``--repeat`` interleaved rounds; the proxy process's CPU time per round
trip (its spinning shows here: on a 2-core host a spinning proxy competes with the endpoints).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PORT = re.compile(r"listening on \S+:(\d+)")
_LATE = re.compile(r"sent ([\d.]+) us after due on average .* read ([\d.]+) us after arrival")


def recv_exact(s: socket.socket, view: memoryview, spin: bool) -> bool:
    """Fills ``view`` from ``s`` (``spin``: non-blocking receives in a loop); False at its end."""
    got, size = 0, len(view)
    while got < size:
        try:
            k = s.recv_into(view[got:], 0, socket.MSG_DONTWAIT if spin else 0)
        except BlockingIOError:
            continue
        if not k:
            return False
        got += k
    return True


def serve_echo(size: int, spin: bool) -> None:
    """The echo process: answers every ``size``-byte message with itself, one connection at a time."""
    srv = socket.create_server(("127.0.0.1", 0))
    print(f"echo listening on 127.0.0.1:{srv.getsockname()[1]}", flush=True)
    buf = bytearray(size)
    view = memoryview(buf)
    while True:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with c:
            while recv_exact(c, view, spin):
                c.sendall(view)


def start(cmd: list[str]) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout is not None
    line = p.stdout.readline()
    m = _PORT.search(line)
    if not m:
        p.kill()
        p.wait()
        raise RuntimeError(f"{cmd[:4]} did not start: {line!r}")
    return p, int(m.group(1))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ping_pong(port: int, size: int, n: int, spin: bool, warmup: int = 200) -> list[float]:
    """Round trip times in us of ``n`` messages of ``size`` bytes, each checked."""
    msg = os.urandom(size)
    back = bytearray(size)
    view = memoryview(back)
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(warmup + n):
            t0 = time.perf_counter_ns()
            s.sendall(msg)
            if not recv_exact(s, view, spin):
                raise RuntimeError("the connection closed mid-message")
            t = time.perf_counter_ns() - t0
            if back != msg:
                raise RuntimeError("the echo came back altered")
            if i >= warmup:
                out.append(t / 1e3)
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=4160, help="message size each way")
    ap.add_argument("--n", type=int, default=5000, help="round trips per row and round")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds")
    ap.add_argument(
        "--rows", nargs="+", default=["direct", "python:0", "c:0", "c:100", "python:100", "c:100:20"]
    )
    ap.add_argument(
        "--endpoint-spin",
        action="store_true",
        help="client and echo busy-poll their receives (no wake-up in any row; wants 2 free cores besides the proxy)",
    )
    ap.add_argument("--serve-echo", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_echo:
        serve_echo(a.serve_echo, a.endpoint_spin)
        return
    echo_cmd = [sys.executable, __file__, "--serve-echo", str(a.bytes)]
    echo, echo_port = start(echo_cmd + ["--endpoint-spin"] * a.endpoint_spin)
    results: dict[str, list[tuple[float, ...]]] = {r: [] for r in a.rows}
    try:
        for _ in range(a.repeat):
            for row in a.rows:
                proxy = None
                port = echo_port
                if row != "direct":
                    impl, delay, *spin = row.split(":")
                    cmd = [sys.executable, "-m", "expertmesh.transport.delay_proxy", "--listen", "127.0.0.1:0",
                           "--to", f"127.0.0.1:{echo_port}", "--delay-us", delay, "--impl", impl]  # fmt: skip
                    if spin:
                        cmd += ["--spin-us", spin[0]]
                    proxy, port = start(cmd)
                late = lag = float("nan")
                try:
                    c0 = cpu_s(proxy.pid) if proxy else 0.0
                    times = ping_pong(port, a.bytes, a.n, a.endpoint_spin)
                    cpu = (cpu_s(proxy.pid) - c0) / a.n * 1e6 if proxy else 0.0
                finally:
                    if proxy:
                        proxy.terminate()
                        out, _ = proxy.communicate(timeout=10)
                        if m := _LATE.search(out):
                            late, lag = float(m.group(1)), float(m.group(2))
                results[row].append((statistics.median(times), pct(times, 0.9), cpu, late, lag))
    finally:
        echo.kill()
        echo.wait()
    direct = statistics.median(r[0] for r in results["direct"]) if "direct" in results else None
    print(f"\n{a.bytes} B each way, {a.n} round trips x {a.repeat} rounds, load {os.getloadavg()[0]:.2f}")
    print(
        "| path | round trip median (us) | p90 (us) | added over direct (us) | proxy CPU per round trip (us)"
        " | C: sent after due, mean (us) | C: read after arrival, mean (us) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row, rs in results.items():
        med, p90, cpu, late, lag = (statistics.median(r[i] for r in rs) for i in range(5))
        spread = f" ({min(r[0] for r in rs):.0f}-{max(r[0] for r in rs):.0f})" if len(rs) > 1 else ""
        added = f"{med - direct:.1f}" if direct is not None and row != "direct" else ""
        c_only = f"{late:.1f} | {lag:.1f}" if late == late else " | "
        print(f"| {row} | {med:.1f}{spread} | {p90:.1f} | {added} | {cpu:.1f} | {c_only} |")


if __name__ == "__main__":
    main()
