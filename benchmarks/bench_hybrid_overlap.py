"""Hybrid decode: one MoE layer split between a GPU expert server and a CPU expert server.

Each token's top-k is drawn as k_gpu experts from the GPU share and k - k_gpu from the CPU share
(k_gpu = k * GPU fraction, the mean under uniform routing). The same tokens are then sent with
only their CPU ids (the CPU server alone) and only their GPU ids (the GPU server alone); the
overlap ratio is hybrid time / max(CPU alone, GPU alone): 1.0 = perfect overlap, 2.0 = serial.

    python benchmarks/bench_hybrid_overlap.py --device cuda --cpu-threads 14
"""

from __future__ import annotations

import argparse
import json
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
from expertmesh.checkpoint import CheckpointReader  # noqa: E402
from tests.cluster_utils import start_server  # noqa: E402


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="the GPU server's device")
    ap.add_argument("--cpu-threads", type=int, default=14)
    ap.add_argument("--gpu-fractions", default="0.5,0.25")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--weight-dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(2)
    e, k = args.experts, args.top_k
    dt = ["--dtype", "bfloat16"]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_moe_layer(Path(tmp), args.hidden, args.inter, e, k, dtype=torch.bfloat16)
        gpu = start_server("gpu", path, 0, "--device", args.device, *dt, timeout=300)
        cpu = start_server(
            "cpu",
            path,
            0,
            "--threads",
            str(args.cpu_threads),
            "--weight-dtype",
            args.weight_dtype,
            *dt,
            timeout=300,
        )
        rows = []
        try:
            reader = CheckpointReader(path)
            for frac in [float(f) for f in args.gpu_fractions.split(",")]:
                n_gpu, k_gpu = round(e * frac), round(k * frac)
                servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
                remote = RemoteDispatcher(
                    reader.config, ClusterConfig(servers, num_gpu_experts=n_gpu), torch.bfloat16
                )
                remote.connect(300)
                for t in [int(s) for s in args.tokens.split(",")]:
                    g = torch.Generator().manual_seed(t)
                    ids = torch.stack(
                        [
                            torch.cat(
                                [
                                    torch.randperm(n_gpu, generator=g)[:k_gpu],
                                    n_gpu + torch.randperm(e - n_gpu, generator=g)[: k - k_gpu],
                                ]
                            )
                            for _ in range(t)
                        ]
                    )  # [T, K]: GPU ids first
                    w = torch.rand(t, k, generator=g)
                    x = torch.randn(t, args.hidden, generator=g).bfloat16()
                    remote.begin_step(t)

                    def run(cols: slice, x=x, ids=ids, w=w, remote=remote) -> float:
                        return median_ms(
                            lambda: remote.submit(0, x, ids[:, cols], w[:, cols]).wait(), args.reps
                        )

                    hybrid, gpu_ms, cpu_ms = run(slice(None)), run(slice(0, k_gpu)), run(slice(k_gpu, k))
                    row = {
                        "gpu_fraction": frac, "T": t, "hybrid_ms": hybrid, "gpu_alone_ms": gpu_ms,
                        "cpu_alone_ms": cpu_ms, "overlap_ratio": hybrid / max(gpu_ms, cpu_ms),
                        "serial_ratio": hybrid / (gpu_ms + cpu_ms),
                    }  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                remote.close()
        finally:
            gpu.stop()
            cpu.stop()
    print(
        f"# one MoE layer, H={args.hidden} I={args.inter} E={e} K={k}, bf16, cpu-server --threads {args.cpu_threads}"
    )
    print("| GPU share | T | hybrid ms | GPU alone ms | CPU alone ms | hybrid / max | hybrid / sum |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['gpu_fraction']:.0%} | {r['T']} | {r['hybrid_ms']:.2f} | {r['gpu_alone_ms']:.2f} "
            f"| {r['cpu_alone_ms']:.2f} | {r['overlap_ratio']:.2f} | {r['serial_ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
