"""Per-layer round trip of a host link carried over TCP by the C relay (expertmesh/transport/relay.c),
beside the Python TCP data path, at Qwen3-30B-A3B widths (H 2048, top-8, bf16).

    python benchmarks/bench_relay.py [--rows 1,8,64] [--layers 48] [--steps 40] [--repeat 3] \\
        [--delay-us 100] [--proxy-impl c,python] [--spin-us 0,20] [--no-python-tcp] [--cuda cuda:0]

Modes, per row count (a decode bucket; every row travels):

- ``areas``: the two stand-ins on ONE pair of areas, no relay and no socket: a C "graph"
  (relay_probe.c: writes a layer's hidden states, publishes its request flag, spins on the
  answer flag) against a C "compute" that answers each new request flag with ``out = x``.
  The floor of the stand-ins themselves.
- ``relay``: the graph on the coordinator's areas, the compute on the server's areas, a
  coordinator relay and a server relay between them over loopback TCP (all in this process,
  C threads only: no Python and no GIL inside the measured loop). Each step is launched with
  ``relay.step`` from the graph stand-in, as the coordinator's host would before a replay.
- ``relay +N us (IMPL proxy)``: the same through ``expertmesh.transport.delay_proxy`` (its C
  or its Python data path, ``--proxy-impl``, in this process) adding N us each way (the proxy's
  own socket hops come on top: compare with ``--delay-us 0``).
- ``python tcp``: the existing Python data path (tcp_client.TcpClient, tcp_server.TcpServer
  with an echo for compute, the server in another process), one request at a time, the
  coordinator's send to its result: what the relay replaces.

``--cuda DEV``: the coordinator's graph is a real CUDA graph on DEV (one per step: per layer
copy the hidden states into the request area, ``link.signal``, ``link.wait`` on the answer
flag, copy the answer out) over its areas mapped into the GPU as the coordinator maps a host
link; ``areas`` is then the GPU <-> host-memory floor (PCIe and polling, no relay), and its
figures are step time / layers.

The row for each mode: per-layer round trip in us, median and p90 over ``--steps`` x
``--layers`` layers, the median over ``--repeat`` interleaved rounds (spread: their min-max).
Every thread spins while it waits (as the link does): on a host with fewer than ~5 free cores
the spinners share cores and the figures measure the scheduler.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from expertmesh import cores  # noqa: E402
from expertmesh.transport import link  # noqa: E402
from expertmesh.transport import relay as rl  # noqa: E402
from expertmesh.transport.delay_proxy import DelayProxy  # noqa: E402

DT = torch.bfloat16


class Areas:
    """One end's request and answer areas (relay.host_areas: one page-aligned host span)."""

    def __init__(self, rows: int, hidden: int, top_k: int) -> None:
        self.span, self.request, self.answer = rl.host_areas(rows, hidden, top_k, DT)
        self.req = link.RequestViews.of(self.request, rows, hidden, top_k, DT)
        self.ans = link.AnswerViews.of(self.answer, rows, hidden, DT)

    def graph_ptrs(self) -> ctypes.Array:
        return _ptrs(self.req.flag, self.req.x, self.ans.flag, self.ans.out)

    def echo_ptrs(self) -> ctypes.Array:
        return _ptrs(self.req.flag, self.req.x, self.ans.flag, self.ans.status, self.ans.out)


def _ptrs(*ts: torch.Tensor) -> ctypes.Array:
    return (ctypes.c_void_p * len(ts))(*(t.data_ptr() for t in ts))


class CGraph:
    """The coordinator's graph as a C thread (relay_probe.c): per-layer round trips."""

    def __init__(self, args: argparse.Namespace, areas: Areas, rows: int, spin_ns: int) -> None:
        lib = rl.load()
        assert lib is not None, rl.unavailable()
        self.lib, self.args, self.areas, self.rows, self.spin_ns = lib, args, areas, rows, spin_ns

    def run(self, relay: rl.Relay | None, step0: int, steps: int) -> np.ndarray:
        """ns per layer [steps * layers]."""
        layers = self.args.layers
        ns = np.zeros(steps * layers, dtype=np.int64)
        rc = self.lib.probe_graph(
            None if relay is None else relay._handle(), self.areas.graph_ptrs(), step0, steps, layers,
            self.rows, self.args.hidden * DT.itemsize, int(10e9), self.spin_ns, ns.ctypes.data,
        )  # fmt: skip
        assert rc == 0, f"probe_graph: {rc}, relay {None if relay is None else relay.stats()}"
        return ns

    def close(self) -> None:
        pass


class CudaGraph:
    """The coordinator's graph for real: one CUDA graph per step on ``--cuda``, with the link's
    flag kernels writing and polling the areas mapped into the GPU (host_map.HostMapped, as
    the coordinator maps a host link); per layer it copies its hidden states into the request
    area, signals, waits for the answer flag and copies the answer out. Timed per step (the
    figure is step time / layers); the last step's answers are checked against its inputs."""

    def __init__(self, args: argparse.Namespace, areas: Areas, rows: int) -> None:
        from expertmesh.transport.host_map import HostMapped

        dev = torch.device(args.cuda)
        link.warm_up(dev)
        self.args, self.rows, self.dev = args, rows, dev
        self.mapped = HostMapped(areas.span, dev)
        span = self.mapped.tensor  # the host span on the GPU, same bytes
        ans_at = areas.answer.data_ptr() - areas.span.data_ptr()
        self.req = link.RequestViews.of(span[:ans_at], rows, args.hidden, args.top_k, DT)
        self.ans = link.AnswerViews.of(span[ans_at:], rows, args.hidden, DT)
        self.word = link.StepWord(dev)
        self.abort = torch.zeros(1, dtype=torch.int64, device=dev)
        self.errors = torch.zeros(1, dtype=torch.int64, device=dev)
        self.xs = torch.randn(args.layers, rows, args.hidden, device=dev).to(DT)  # [L, T, H]
        self.outs = torch.zeros_like(self.xs)
        self.stream = torch.cuda.Stream(dev)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _body(self) -> None:
        self.word.copy_in()
        for i in range(self.args.layers):
            self.req.x.copy_(self.xs[i])
            link.signal(self.req.flag, self.word.step, i)
            link.wait(self.ans.flag, self.word.step, i, self.abort, self.errors, 10.0)
            self.outs[i].copy_(self.ans.out)

    def run(self, relay: rl.Relay | None, step0: int, steps: int) -> np.ndarray:
        layers = self.args.layers
        ns = np.zeros(steps * layers, dtype=np.int64)
        for s in range(steps):
            step = step0 + s
            self.outs.zero_()
            torch.cuda.synchronize(self.dev)
            t0 = time.perf_counter_ns()
            if relay is not None:
                why = relay.step(step, self.rows, layers)
                assert not why, why
            self.word.set(step, self.rows)
            with torch.cuda.stream(self.stream):
                if self.graph is None:  # the first step eagerly: every kernel loaded before a capture
                    self._body()
                else:
                    self.graph.replay()
            self.word.replayed()
            self.stream.synchronize()
            ns[s * layers : (s + 1) * layers] = (time.perf_counter_ns() - t0) // layers
            assert int(self.errors) == 0, f"step {step}: error bits {int(self.errors)}"
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.stream):
                    self._body()
        assert torch.equal(self.outs, self.xs), "the answers are not the hidden states sent"
        return ns

    def close(self) -> None:
        self.graph = None
        torch.cuda.synchronize(self.dev)
        self.mapped.close()


def _graph(args: argparse.Namespace, areas: Areas, rows: int, spin_ns: int) -> CGraph | CudaGraph:
    return CudaGraph(args, areas, rows) if args.cuda else CGraph(args, areas, rows, spin_ns)


class RelayPath:
    """Graph stand-in -> coordinator relay -> TCP (-> delay proxy) -> server relay -> compute stand-in."""

    def __init__(
        self, args: argparse.Namespace, rows: int, delay_us: float | None, spin_us: float, impl: str = "auto"
    ) -> None:
        lib = rl.load()
        assert lib is not None, rl.unavailable()
        self.lib, spin_ns = lib, int(spin_us * 1e3)
        cfg = rl.RelayConfig(timeout_s=10.0, spin_us=spin_us)
        h, k = args.hidden, args.top_k
        self.stack = contextlib.ExitStack()
        a, s = Areas(rows, h, k), Areas(rows, h, k)
        self.co = self.stack.enter_context(rl.Relay.coordinator(a.request, a.answer, rows, h, k, DT, cfg))
        # NOTE: the server's relay waits for its compute less long than the coordinator's for it
        srv_cfg = rl.RelayConfig(timeout_s=5.0, spin_us=spin_us)
        self.srv = self.stack.enter_context(rl.Relay.server(s.request, s.answer, rows, h, k, DT, srv_cfg))
        listener = self.stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        port = listener.getsockname()[1]
        if delay_us is not None:
            port = self.stack.enter_context(
                DelayProxy(("127.0.0.1", port), delay_us=delay_us, impl=impl)
            ).port
        c = socket.create_connection(("127.0.0.1", port), timeout=10)
        srv_sock, _ = listener.accept()
        assert self.srv.attach(srv_sock) and self.co.attach(c)
        self.echo = lib.probe_echo_start(s.echo_ptrs(), rows * h * DT.itemsize, spin_ns)
        self.graph = _graph(args, a, rows, spin_ns)
        self.step = 1

    def run(self, steps: int) -> np.ndarray:
        ns = self.graph.run(self.co, self.step, steps)
        assert self.co.wait_idle(10)
        self.step += steps
        assert self.co.stats().last_bits == 0, self.co.stats()
        return ns

    def close(self) -> None:
        self.graph.close()
        self.lib.probe_echo_stop(self.echo)
        self.stack.close()


class AreasPath:
    """Both stand-ins on one pair of areas: no relay, no socket (their own floor)."""

    def __init__(self, args: argparse.Namespace, rows: int, spin_us: float) -> None:
        lib = rl.load()
        assert lib is not None, rl.unavailable()
        self.lib, spin_ns = lib, int(spin_us * 1e3)
        self.a = Areas(rows, args.hidden, args.top_k)
        self.echo = lib.probe_echo_start(self.a.echo_ptrs(), rows * args.hidden * DT.itemsize, spin_ns)
        self.graph = _graph(args, self.a, rows, spin_ns)
        self.step = 1

    def run(self, steps: int) -> np.ndarray:
        ns = self.graph.run(None, self.step, steps)
        self.step += steps
        return ns

    def close(self) -> None:
        self.graph.close()
        self.lib.probe_echo_stop(self.echo)


class PythonTcpPath:
    """The Python TCP data path: TcpClient here, a TcpServer echoing the hidden states in a
    child process (the handshake's Hello passed on its command line instead of over gRPC)."""

    def __init__(self, args: argparse.Namespace, rows: int) -> None:
        from expertmesh.transport.handshake import Ack
        from expertmesh.transport.tcp_client import TcpClient

        self.args, self.rows = args, rows
        cap = 8 << 20
        self.client = TcpClient(cap, torch.device("cpu"), spin_us=args.python_spin_us)
        cmd = [sys.executable, __file__, "_tcp-echo", self.client.hello().hex(), str(args.python_spin_us)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.client.accept(Ack("tcp", tcp={"port": port, "tls": False, "buffer": cap}))
        self.x = torch.randn(rows, args.hidden).to(DT)
        self.ids = torch.zeros(rows, args.top_k, dtype=torch.int32)
        self.w = torch.rand(rows, args.top_k)
        self.seq = 0

    def run(self, steps: int) -> np.ndarray:
        from expertmesh.worker_api import ExpertRequest

        ns = np.zeros(steps * self.args.layers, dtype=np.int64)
        for j in range(len(ns)):
            self.seq += 1
            t0 = time.perf_counter_ns()
            r = self.client.send(ExpertRequest(self.seq, 0, j, self.x, self.ids, self.w), DT)
            assert r is not None
            r.result(10)
            r.release()
            ns[j] = time.perf_counter_ns() - t0
        return ns

    def close(self) -> None:
        self.client.close()
        self.proc.kill()
        self.proc.wait()


def _tcp_echo(hello_hex: str, spin_us: float) -> None:
    import threading

    from expertmesh.transport.handshake import Hello
    from expertmesh.transport.tcp_server import DataListener, TcpServer

    torch.set_num_threads(1)
    listener = DataListener("127.0.0.1", 0, None)
    hello = Hello.decode(bytes.fromhex(hello_hex))
    srv = TcpServer(
        hello, listener, torch.device("cpu"), lambda r: r.hidden, lambda *a: None, spin_us=spin_us
    )
    srv.start()
    print(listener.port, flush=True)
    threading.Event().wait()  # until the parent kills this process


def _stats(ns: np.ndarray) -> tuple[float, float]:
    return float(np.median(ns)) / 1e3, float(np.percentile(ns, 90)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=48, help="MoE layers a step")
    ap.add_argument("--steps", type=int, default=40, help="steps a round")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--delay-us", default="100", help="comma-separated added one-way delays ('' for none)")
    ap.add_argument(
        "--spin-us",
        default="0,20",
        help="comma-separated: the relays' (and the stand-ins') pause-spin before yielding",
    )
    ap.add_argument(
        "--python-spin-us",
        type=float,
        default=None,
        help="the Python path's spin (default: the servers' default here)",
    )
    ap.add_argument("--no-python-tcp", action="store_true", help="skip the Python TCP path")
    ap.add_argument(
        "--proxy-impl", default="auto", help="comma-separated: the delay proxy's data paths (c, python, auto)"
    )
    ap.add_argument(
        "--cuda", default="", help="a CUDA device (cuda:0): the coordinator's graph is a real CUDA graph"
    )
    if sys.argv[1:2] == ["_tcp-echo"]:
        return _tcp_echo(sys.argv[2], float(sys.argv[3]))
    args = ap.parse_args()
    if args.python_spin_us is None:
        args.python_spin_us = cores.default_spin_us()
    if rl.load() is None:
        sys.exit(rl.unavailable())
    delays = [float(d) for d in args.delay_us.split(",") if d]
    spins = [float(d) for d in args.spin_us.split(",")]
    print(
        f"# relay per-layer round trip: H={args.hidden} K={args.top_k} bf16, {args.layers} layers x "
        f"{args.steps} steps a round, {args.repeat} rounds, python tcp spin {args.python_spin_us:g} us, "
        f"{os.cpu_count()} CPUs, graph {'CUDA ' + args.cuda if args.cuda else 'a C thread'}; "
        "us per layer (median of round medians / of round p90s)"
    )
    print("| mode | rows | bytes each way | median us | spread | p90 us |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        makers: dict[str, Callable[[], AreasPath | RelayPath | PythonTcpPath]] = {}
        for sp in spins:
            makers[f"areas (no relay), spin {sp:g}"] = lambda rows=rows, sp=sp: AreasPath(args, rows, sp)
            makers[f"relay, spin {sp:g}"] = lambda rows=rows, sp=sp: RelayPath(args, rows, None, sp)
            for d in delays:
                for impl in args.proxy_impl.split(","):
                    makers[f"relay +{d:g} us ({impl} proxy), spin {sp:g}"] = (
                        lambda rows=rows, d=d, sp=sp, impl=impl: RelayPath(args, rows, d, sp, impl)
                    )
        if not args.no_python_tcp:
            makers["python tcp"] = lambda rows=rows: PythonTcpPath(args, rows)
        paths: dict[str, AreasPath | RelayPath | PythonTcpPath] = {}
        try:
            for name, make in makers.items():
                paths[name] = make()
            for p in paths.values():
                p.run(2)  # warm-up: first frames, page faults
            results: dict[str, list[tuple[float, float]]] = {n: [] for n in paths}
            for _ in range(args.repeat):
                for name, p in paths.items():
                    results[name].append(_stats(p.run(args.steps)))
        finally:
            for p in paths.values():
                p.close()
        nbytes = rows * args.hidden * DT.itemsize
        for name, rs in results.items():
            meds, p90s = [m for m, _ in rs], [p for _, p in rs]
            print(
                f"| {name} | {rows} | {nbytes // 1024} KiB | {statistics.median(meds):.1f} | "
                f"{min(meds):.1f}-{max(meds):.1f} | {statistics.median(p90s):.1f} |"
            )


if __name__ == "__main__":
    main()
