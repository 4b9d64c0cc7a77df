"""Coordinator <-> expert server data paths compared: gRPC, shared memory, CUDA IPC.

    python benchmarks/bench_transport.py layer  [--payload-kib 8,64,1024,8192] [--transports grpc,shm]
    python benchmarks/bench_transport.py layer  --device cuda --dtype bfloat16 --tokens 1,8,64,512 \\
                                                --transports grpc,shm,cuda_ipc
    python benchmarks/bench_transport.py decode [--transports grpc,shm] [--new-tokens 64]
    python benchmarks/bench_transport.py decode --variants 'up;up --transport grpc;up --threads 1'

``layer``: one MoE layer (H=2048, small experts so that transport dominates) on one expert
server process: a CPU server, or with ``--device cuda`` a GPU server with the coordinator's
tensors on the same GPU. Per payload (T tokens x H x dtype each way) and path:

- ``bare rt``: one request whose slot ids are all -1 (the server validates it and computes
  nothing), submit to result at the connection: the transport's own round trip;
  ``GB/s`` = both directions' bytes / bare rt.
- ``layer rt``: the whole dispatcher (routing split, send, wait, merge) with real experts, and
  ``over`` = layer rt - the same layer computed in this process (same backend and device):
  what running the experts in another process costs.

Paths are measured interleaved, ``--repeat`` rounds of ``--reps`` each; the table shows the
median of the round medians (the machine may be shared: look at the spread column too).

``decode``: ``expertmesh up`` (coordinator + GPU server + CPU server, demo model) per path,
one greedy request at a time; decode tokens/s = (tokens - 1) / (last token - first token).
With ``--variants``, each variant is an ``expertmesh up`` command line run with its defaults
(no ``OMP_NUM_THREADS``), launched in rotating order each round, and compared with the best
variant of the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.synthetic import write_moe_layer  # noqa: E402
from coordinator.experts.remote import ClusterConfig, RemoteDispatcher, ServerSpec  # noqa: E402
from coordinator.model.dispatch import LocalDispatcher  # noqa: E402
from expertmesh import placement as pl  # noqa: E402
from expertmesh.checkpoint import CheckpointReader  # noqa: E402
from expertmesh.wire import parse_dtype  # noqa: E402
from expertmesh.worker_api import ExpertRequest  # noqa: E402
from tests.cluster_utils import start_server  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, reps: int, device: torch.device) -> float:
    for _ in range(min(10, reps)):
        fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ---------------------------------------------------------------------- echo


def _echo_server(device: str, spin_us: float) -> None:
    """A Forward stream that answers each request with its own hidden states: gRPC messages,
    or (after a handshake) the shared-memory channel; no validation, no experts."""
    import grpc

    from expertmesh import wire
    from expertmesh.transport.handshake import Hello
    from expertmesh.transport.server import ShmServer
    from expertmesh.v1 import expert_worker_pb2 as pb
    from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
    from expertmesh.worker.server import grpc_options

    dev = torch.device(device)

    class Echo(pb_grpc.ExpertWorkerServicer):
        async def Forward(self, it, context):
            fast = None
            try:
                async for req in it:
                    if req.fast_path:
                        # identity "experts": the hidden states go to the server's device and back
                        hello = Hello.decode(req.fast_path)
                        fast = ShmServer(hello, dev, lambda r: r.hidden.to(dev), spin_us=spin_us)
                        ack = await asyncio.wrap_future(fast.start())
                        yield pb.ForwardResponse(seq=0, fast_path=ack.encode())
                        continue
                    x = wire.decode(req.hidden)
                    wire.decode(req.slot_ids), wire.decode(req.weights)
                    yield pb.ForwardResponse(seq=req.seq, output=wire.encode(x.to(dev)))
            finally:
                if fast is not None:
                    fast.close()

    async def serve() -> None:
        server = grpc.aio.server(options=grpc_options(1 << 30))
        pb_grpc.add_ExpertWorkerServicer_to_server(Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


class _EchoClient:
    """The coordinator's side of the echo: the same stream structure as ServerConnection
    (a request queue, a reader thread, futures by sequence number), and the same fast path."""

    def __init__(self, port: int, transport: str, device: torch.device, spin_us: float) -> None:
        import queue
        import threading
        from concurrent.futures import Future

        import grpc

        from expertmesh.transport.client import ShmClient
        from expertmesh.transport.handshake import Ack
        from expertmesh.v1 import expert_worker_pb2 as pb
        from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
        from expertmesh.worker.server import grpc_options

        self.pb, self.Future = pb, Future
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options(1 << 30))
        self.q: queue.Queue = queue.Queue()
        self.call = pb_grpc.ExpertWorkerStub(self.channel).Forward(iter(self.q.get, None))
        self.pending: dict = {}
        self.seq = 0
        threading.Thread(target=self._read, daemon=True).start()
        self.fast = None
        if transport != "grpc":
            # cuda_ipc_local / cuda_ipc_stream: CUDA IPC with another ordering (cuda_ipc.SYNC_MODES)
            kind, _, sync = transport.partition("_ipc_")
            kind, sync = ("cuda_ipc", sync) if sync else (transport, "host")
            self.fast = ShmClient(kind, 64 << 20, device, spin_us, cuda_sync=sync)
            fut = self._send(pb.ForwardRequest(seq=0, fast_path=self.fast.hello()))
            ack = Ack.decode(fut.result(30).fast_path)
            assert ack.transport == kind, ack
            self.fast.accept(ack)

    def _read(self) -> None:
        import grpc

        try:
            for resp in self.call:
                self.pending.pop(resp.seq).set_result(resp)
        except grpc.RpcError:  # closed at the end of the run
            pass

    def _send(self, req):
        fut = self.Future()
        self.pending[req.seq] = fut
        self.q.put(req)
        return fut

    def round_trip(self, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, w: torch.Tensor) -> None:
        from expertmesh import wire

        self.seq += 1
        if self.fast is not None:
            r = self.fast.send(ExpertRequest(self.seq, 0, 0, x, slots, w, rows=rows), x.dtype)
            assert r is not None
            r.result(30)
            r.release()
            return
        req = self.pb.ForwardRequest(
            seq=self.seq, hidden=wire.encode(x[rows]), slot_ids=wire.encode(slots), weights=wire.encode(w)
        )
        wire.decode(self._send(req).result(30).output).to(x.device)

    def close(self) -> None:
        self.q.put(None)
        if self.fast is not None:
            self.fast.close()
        self.channel.close()


def echo(args: argparse.Namespace) -> None:
    dev, dtype = torch.device(args.device), parse_dtype(args.dtype)
    tokens = _tokens(args, dtype.itemsize)
    transports = args.transports.split(",")
    torch.set_num_threads(1)
    cmd = [sys.executable, __file__, "_echo-server", args.device, str(args.spin_us)]
    srv = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    try:
        assert srv.stdout is not None
        port = int(srv.stdout.readline())
        clients = {t: _EchoClient(port, t, dev, args.spin_us) for t in transports}
        rows: dict[tuple, list[float]] = {}
        for _ in range(args.repeat):
            for t in tokens:
                x = torch.randn(t, args.hidden).to(dev, dtype)
                idx, slots = torch.arange(t), torch.zeros(t, args.top_k, dtype=torch.int32)
                w = torch.rand(t, args.top_k)
                for name, c in clients.items():
                    rows.setdefault((t, name), []).append(
                        _median_time(lambda c=c, a=(x, idx, slots, w): c.round_trip(*a), args.reps, dev)
                    )
        for c in clients.values():
            c.close()
    finally:
        srv.kill()
        srv.wait()
    print(
        f"\n# echo round trip (transport only: no validation, no experts), H={args.hidden} {args.dtype}, "
        f"spin {args.spin_us:g} us, "
        f"device {args.device}, {args.repeat} rounds x {args.reps} reps; microseconds (median of round medians)"
    )
    head = ["payload/way", "T"]
    for tr in transports:
        head += [f"{tr} us", "spread", f"{tr} GB/s"]
    head += [f"grpc/{tr}" for tr in transports if tr != "grpc" and "grpc" in transports]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for t in tokens:
        payload = t * args.hidden * dtype.itemsize
        cells = [_size(payload), str(t)]
        for tr in transports:
            v = rows[t, tr]
            m = statistics.median(v)
            cells += [
                f"{m * 1e6:.0f}",
                f"{min(v) * 1e6:.0f}-{max(v) * 1e6:.0f}",
                f"{2 * payload / m / 1e9:.2f}",
            ]
        if "grpc" in transports:
            g = statistics.median(rows[t, "grpc"])
            cells += [f"{g / statistics.median(rows[t, tr]):.1f}x" for tr in transports if tr != "grpc"]
        print("| " + " | ".join(cells) + " |")


def _size(payload: int) -> str:
    return f"{payload / 1024:.0f} KiB" if payload < 1 << 20 else f"{payload / (1 << 20):.0f} MiB"


def _tokens(args: argparse.Namespace, itemsize: int) -> list[int]:
    if args.tokens:
        return [int(t) for t in args.tokens.split(",")]
    return [max(1, int(k) * 1024 // (args.hidden * itemsize)) for k in args.payload_kib.split(",")]


# ---------------------------------------------------------------------- layer


def layer(args: argparse.Namespace) -> None:
    dev, dtype = torch.device(args.device), parse_dtype(args.dtype)
    isz, h = dtype.itemsize, args.hidden
    tokens = _tokens(args, isz)
    transports = args.transports.split(",")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_moe_layer(Path(tmp), h, args.inter, args.experts, args.top_k, dtype)
        if dev.type == "cuda":
            srv = start_server("gpu", path, 0, "--device", str(dev), "--dtype", args.dtype, timeout=300)
        else:
            srv = start_server("cpu", path, 0, "--threads", "1", "--dtype", args.dtype)
        try:
            reader = CheckpointReader(path)
            spec = (ServerSpec("s0", srv.address, "gpu" if dev.type == "cuda" else "cpu"),)
            remotes = {}
            for t in transports:
                cluster = ClusterConfig(spec, transport=t, timeout_s=300)  # first calls compile kernels
                d = RemoteDispatcher(reader.config, cluster, dtype, dev)
                d.connect(300)
                got = d.server_infos()[0]["transport"]
                assert got == t or t == "auto", f"asked for {t}, got {got}: {d.server_infos()[0]}"
                remotes[t] = d
            # NOTE: each connect pushed the same placement under a newer generation; all
            # dispatchers use the live one (the slot tables are identical)
            live = max(d.placement.generation for d in remotes.values())
            for d in remotes.values():
                c = d.expert_cluster
                c.tables = pl.server_tables(c.placement.with_generation(live))
            backend = None
            if dev.type == "cuda":
                from gpu_server.backend import make_backend

                backend = make_backend(str(dev))
            local = LocalDispatcher(reader, dtype, dev, backend)
            rows = {}  # (T, what, transport) -> [round medians]
            for _ in range(args.repeat):
                for t in tokens:
                    g = torch.Generator().manual_seed(t)
                    x = torch.randn(t, h, generator=g).to(dev, dtype)
                    ids = torch.stack(
                        [torch.randperm(args.experts, generator=g)[: args.top_k] for _ in range(t)]
                    )
                    w = torch.rand(t, args.top_k, generator=g)
                    ids_d, w_d = ids.to(dev), w.to(dev)
                    bare = pl.ServerBatch(
                        0, torch.arange(t), torch.full((t, args.top_k), -1, dtype=torch.int32), w
                    )
                    rows.setdefault((t, "local", ""), []).append(
                        _median_time(lambda a=(x, ids_d, w_d): local.submit(0, *a).wait(), args.reps, dev)
                    )
                    for name, d in remotes.items():
                        d.begin_step(t)
                        conn = d.conns[0]

                        server_ms: list[float] = []

                        def bare_rt(conn=conn, d=d, x=x, bare=bare, server_ms=server_ms) -> None:
                            req = ExpertRequest(
                                conn.next_seq(),
                                d.placement.generation,
                                0,
                                x,
                                bare.slot_ids,
                                bare.weights,
                                rows=bare.rows,
                            )
                            r = conn.submit(req)
                            r.result(30)
                            r.release()
                            if hasattr(r, "reply"):  # fast path: the server's own time
                                server_ms.append(r.reply.server_ms)

                        rows.setdefault((t, "bare", name), []).append(_median_time(bare_rt, args.reps, dev))
                        if server_ms:
                            rows.setdefault((t, "server", name), []).append(
                                statistics.median(server_ms) * 1e-3
                            )
                        rows.setdefault((t, "layer", name), []).append(
                            _median_time(
                                lambda d=d, a=(x, ids_d, w_d): d.submit(0, *a).wait(), args.reps, dev
                            )
                        )
            for d in remotes.values():
                print(
                    f"# {d.server_infos()[0]['name']} via {d.server_infos()[0]['transport']}", file=sys.stderr
                )
                d.close()
        finally:
            srv.stop()
    _print_layer_table(args, tokens, transports, rows, h * isz)


def _print_layer_table(args, tokens, transports, rows, row_bytes) -> None:
    def med(key) -> float:
        return statistics.median(rows[key])

    def spread(key) -> str:
        v = sorted(rows[key])
        return f"{v[0] * 1e6:.0f}-{v[-1] * 1e6:.0f}"

    print(
        f"\n# one MoE layer, H={args.hidden} I={args.inter} E={args.experts} K={args.top_k} {args.dtype}, "
        f"device {args.device}, {args.repeat} rounds x {args.reps} reps, medians in microseconds"
    )
    head = ["payload/way", "T", "in-process"]
    for tr in transports:
        head += [f"{tr} bare rt", "(spread)", f"{tr} server", f"{tr} GB/s", f"{tr} layer rt", f"{tr} over"]
    if "grpc" in transports:
        head += [f"bare grpc/{tr}" for tr in transports if tr != "grpc"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for t in tokens:
        payload = t * row_bytes
        size = f"{payload / 1024:.0f} KiB" if payload < 1 << 20 else f"{payload / (1 << 20):.0f} MiB"
        loc = med((t, "local", ""))
        cells = [size, str(t), f"{loc * 1e6:.0f}"]
        for tr in transports:
            b, lay = med((t, "bare", tr)), med((t, "layer", tr))
            srv = f"{med((t, 'server', tr)) * 1e6:.0f}" if (t, "server", tr) in rows else "-"
            cells += [
                f"{b * 1e6:.0f}",
                spread((t, "bare", tr)),
                srv,
                f"{2 * payload / b / 1e9:.2f}",
                f"{lay * 1e6:.0f}",
                f"{(lay - loc) * 1e6:.0f}",
            ]
        if "grpc" in transports:
            g = med((t, "bare", "grpc"))
            cells += [f"{g / med((t, 'bare', tr)):.1f}x" for tr in transports if tr != "grpc"]
        print("| " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------- decode


def _launch(model: Path, transport: str, device: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    """``expertmesh up`` over ``transport``, or (``in-process``) a coordinator with every expert.

    ``transport`` may instead be ``up`` followed by ``up``'s own flags (``up``, ``up --threads 1``,
    ``up --transport grpc``): then nothing else is added, ``OMP_NUM_THREADS`` is unset, and
    ``up`` runs with its defaults except for those flags (``--variants``)."""
    cli = [sys.executable, "-m", "expertmesh.cli"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if transport.split()[0] == "up":
        cmd = [*cli, "up", "--model", str(model), *transport.split()[1:]]
        env.pop("OMP_NUM_THREADS", None)
        env.pop("MKL_NUM_THREADS", None)
    elif transport == "in-process":
        cmd = [*cli, "coordinator", "--model", str(model), "--port", "0", "--threads", str(threads)]
        cmd += ["--device", device]
    else:
        cmd = [*cli, "up", "--model", str(model), "--transport", transport]
        cmd += ["--device", device, "--threads", str(threads)]
        if device.startswith("cuda"):
            cmd += ["--coordinator-device", device]
    if threads is not None and transport.split()[0] != "up":
        env["OMP_NUM_THREADS"] = str(threads)
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    out = []
    for line in p.stdout:
        out.append(line)
        m = re.search(r"(?:serving|coordinator listening) on (\S+:\d+)", line)
        if m:
            import threading

            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()  # type: ignore[union-attr]
            return p, m.group(1)
    raise RuntimeError(f"expertmesh up --transport {transport} failed:\n{''.join(out[-20:])}")


async def _decode_rate(addr: str, new_tokens: int, requests: int) -> list[float]:
    from expertmesh.client import AsyncClient

    rates = []
    async with AsyncClient(addr) as client:
        for i in range(requests + 1):
            stamps = []
            async for chunk in client.stream(
                input_ids=[5 + i, 17, 42, 7], max_new_tokens=new_tokens, ignore_eos=True
            ):
                stamps += [time.perf_counter()] * len(chunk.token_ids)
            if i:  # the first request warms up
                rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return rates


def decode(args: argparse.Namespace) -> None:
    from benchmarks.bench_serving import prepare_model

    names = args.variants.split(";") if args.variants else args.transports.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model, what = prepare_model(args.model, Path(tmp))
        rates: dict[str, list[float]] = {t: [] for t in names}
        rounds: dict[str, list[float]] = {t: [] for t in names}  # one median per launch
        for i in range(args.repeat):
            # NOTE: the order rotates each round so that no variant always follows the same one
            for tr in names[i % len(names) :] + names[: i % len(names)]:
                proc, addr = _launch(model, tr, args.device, args.threads)
                try:
                    got = asyncio.run(_decode_rate(addr, args.new_tokens, args.requests))
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(60)
                rates[tr] += got
                rounds[tr].append(statistics.median(got))
                print(f"round {i + 1}: {tr}: {statistics.median(got):.1f} tok/s", file=sys.stderr, flush=True)
    if args.variants:
        _print_variants(args, what, names, rates, rounds)
        return
    print(f"\n# decode, {what}, `expertmesh up --device {args.device} --threads {args.threads}`, batch 1")
    print("| transport | decode tok/s (median) | min-max | requests |")
    print("|---|---|---|---|")
    for tr, r in rates.items():
        print(f"| {tr} | {statistics.median(r):.1f} | {min(r):.1f}-{max(r):.1f} | {len(r)} |")


def _print_variants(args, what: str, names: list[str], rates: dict, rounds: dict) -> None:
    """Per variant: the median over all requests, the spread of the per-launch medians, and the
    median over rounds of (this variant / the best variant of that round): on a shared machine
    the ratio within a round is steadier than any absolute number."""
    n = len(rounds[names[0]])
    best = [max(rounds[v][i] for v in names) for i in range(n)]
    print(f"\n# decode, {what}, `expertmesh up VARIANT`, batch 1, {args.repeat} interleaved rounds")
    print("| variant | decode tok/s (median) | launch medians min-max | vs best of its round (median) |")
    print("|---|---|---|---|")
    for v in names:
        rel = statistics.median(rounds[v][i] / best[i] for i in range(n))
        r = rounds[v]
        print(f"| `{v}` | {statistics.median(rates[v]):.1f} | {min(r):.1f}-{max(r):.1f} | {rel:.2f} |")


def _layer_arguments(a: argparse.ArgumentParser) -> None:
    a.add_argument("--hidden", type=int, default=2048)
    a.add_argument("--inter", type=int, default=128)
    a.add_argument("--experts", type=int, default=16)
    a.add_argument("--top-k", type=int, default=4)
    a.add_argument("--dtype", default="float32")
    a.add_argument("--device", default="cpu")
    a.add_argument(
        "--payload-kib", default="8,64,1024,8192", help="payload each way (T = payload / (H x dtype))"
    )
    a.add_argument("--tokens", default=None, help="token counts instead of payload sizes")
    a.add_argument("--transports", default="grpc,shm")
    a.add_argument("--reps", type=int, default=100)
    a.add_argument("--repeat", type=int, default=3)
    a.add_argument("--spin-us", type=float, default=300.0, help="echo: fast paths' spin before sleeping")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    for mode in ("echo", "layer"):
        _layer_arguments(sub.add_parser(mode))
    b = sub.add_parser("decode")
    b.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    b.add_argument("--transports", default="grpc,shm")
    b.add_argument("--device", default="cpu", help="GPU expert server's device (and the coordinator's)")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument(
        "--variants",
        default=None,
        help="instead of --transports: ';'-separated `up` command lines, e.g. "
        "'up;up --transport grpc;up --threads 1' (each with up's defaults otherwise)",
    )
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--requests", type=int, default=3)
    b.add_argument("--repeat", type=int, default=2)
    if sys.argv[1:2] == ["_echo-server"]:
        return _echo_server(sys.argv[2], float(sys.argv[3]))
    args = ap.parse_args()
    {"echo": echo, "layer": layer, "decode": decode}[args.mode](args)


if __name__ == "__main__":
    main()
