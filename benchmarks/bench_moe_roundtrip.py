"""One MoE layer: coordinator -> expert server -> coordinator over the real transport, against
the same layer computed in process.

    python benchmarks/bench_moe_roundtrip.py [--hidden 2048] [--tokens 1,8,64,512] [--transport grpc]

Prints, per T: payload each way, in-process compute, round trip, server-side compute (as the
server reports it) and transport overhead = round trip - server compute.
"""

from __future__ import annotations

import argparse
import statistics
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
from expertmesh.checkpoint import CheckpointReader  # noqa: E402
from expertmesh.v1 import expert_worker_pb2 as pb  # noqa: E402
from tests.cluster_utils import start_server  # noqa: E402


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=128, help="small: this measures transport, not compute")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--transport", default="grpc", choices=["grpc", "shm", "auto"])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_moe_layer(Path(tmp), args.hidden, args.inter, args.experts, args.top_k)
        srv = start_server("cpu", path, 0, "--threads", "1")
        try:
            reader = CheckpointReader(path)
            cluster = ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),), transport=args.transport)
            remote = RemoteDispatcher(reader.config, cluster, torch.float32)
            remote.connect(60)
            local = LocalDispatcher(reader, torch.float32, torch.device("cpu"))
            print(
                f"# one MoE layer round trip, H={args.hidden} I={args.inter} E={args.experts} K={args.top_k}, "
                f"fp32, transport={args.transport}, torch threads=1"
            )
            print(
                f"{'T':>5} {'payload/way':>12} {'in-process ms':>14} {'round trip ms':>14} "
                f"{'server compute ms':>18} {'transport ms':>13} {'transport MB/s':>15}"
            )
            for t in [int(s) for s in args.tokens.split(",")]:
                g = torch.Generator().manual_seed(t)
                x = torch.randn(t, args.hidden, generator=g)
                ids = torch.stack([torch.randperm(args.experts, generator=g)[: args.top_k] for _ in range(t)])
                w = torch.rand(t, args.top_k, generator=g)
                in_proc = timed(lambda x=x, ids=ids, w=w: local.submit(0, x, ids, w).wait(), args.reps)
                remote.begin_step(t)
                rtt = timed(lambda x=x, ids=ids, w=w: remote.submit(0, x, ids, w).wait(), args.reps)
                st = remote.conns[0].stub
                s0 = st.Stats(pb.StatsRequest())
                n = 10
                for _ in range(n):
                    remote.submit(0, x, ids, w).wait()
                s1 = st.Stats(pb.StatsRequest())
                server_ms = (s1.compute_seconds - s0.compute_seconds) / n * 1e3
                payload = t * args.hidden * 4
                overhead = max(rtt - server_ms, 1e-6)
                print(
                    f"{t:>5} {payload / 1024:>9.0f} KiB {in_proc:>14.3f} {rtt:>14.3f} {server_ms:>18.3f} "
                    f"{overhead:>13.3f} {2 * payload / overhead / 1e3:>15.0f}"
                )
            remote.close()
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
