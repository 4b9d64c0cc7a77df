"""A CPU expert kernel called from the thread that started the process's first OpenMP team
against the same call from a second thread (its own team), in one process.

Why: libgomp gives every thread that starts a parallel region a team of its own, and once the
teams' threads outnumber the CPUs a worker spins only briefly before it sleeps, so each region
of the second team waits on wake-ups. The CPU expert server has such second threads: each host
link's pthread, each fast-path channel's thread and the gRPC compute thread start their own
teams (benchmarks/RESULTS.md, "bf16 CPU rows on the links"). The backend now starts every
kernel from one kernel thread of its own (cpu_expert_server/kernels KernelThread); the rows
``direct`` (``kernel_thread=False``: each calling thread starts its own team, as before) are
the baseline in the same run, each mode in a process of its own.

Columns: median microseconds per ``CpuExpertBackend.forward`` call of one token (top-K of S
experts, random ids, a short sleep between calls as between layers), from the main thread, then
from a second thread, then from the main thread again; ``--rounds`` repeats the three per mode.

    python3 benchmarks/bench_omp_teams.py                                  # small widths: the wake-ups dominate
    python3 benchmarks/bench_omp_teams.py --hidden 2048 --inter 768 --experts 32 --top-k 8 --threads 28
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

from cpu_expert_server import kernels
from cpu_expert_server.backend import CpuExpertBackend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--weight-dtype", default="bfloat16")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--gap-us", type=float, default=300.0, help="sleep between calls")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spin-us", default=str(kernels.KT_SPIN_US),
                   help="comma list: the kernel thread's idle spin (kernels.KT_SPIN_US), a row each")  # fmt: skip
    p.add_argument("--mode", help="(internal) one mode, in this process")
    args = p.parse_args()
    h, i, s, k = args.hidden, args.inter, args.experts, args.top_k
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(s, 2 * i, h, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(s, h, i, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, h, generator=g).to(torch.bfloat16)
    weights = torch.rand(1, k, generator=g)
    if args.mode is None:
        print(
            f"{args.weight_dtype} H {h} I {i}, top-{k} of {s} experts, {args.threads} threads, {args.calls} calls"
        )
    if args.mode is None:
        print("| mode | round | main thread us | second thread us | main thread again us | second / main |")
        print("|---|---|---:|---:|---:|---:|")
        # NOTE: a process per mode: one mode's teams must not exist while the other's rows run
        modes = ["direct"] + [f"kernel thread, spin {u} us" for u in args.spin_us.split(",")]
        for mode in modes:
            subprocess.run([sys.executable, *sys.argv, "--mode", mode], check=True)
        return
    if args.mode.startswith("kernel thread, spin "):
        kernels.KT_SPIN_US = float(args.mode.split()[-2])  # read when the thread starts
    backend = CpuExpertBackend(
        threads=args.threads, weight_dtype=args.weight_dtype, kernel_thread=args.mode != "direct"
    )
    p13, p2 = backend.pack_weights(w13, w2)
    rows(args, backend, args.mode, (x, p13, p2, weights))


def rows(args, backend: CpuExpertBackend, mode: str, call: tuple) -> None:
    x, p13, p2, weights = call
    s, k = args.experts, args.top_k

    def timed(out: list[float]) -> None:
        rng = torch.Generator().manual_seed(1)
        ts = []
        for _ in range(args.calls):
            ids = torch.randperm(s, generator=rng)[:k][None]
            t0 = time.perf_counter()
            backend.forward(x, p13, p2, ids, weights)
            ts.append(time.perf_counter() - t0)
            time.sleep(args.gap_us / 1e6)
        out.append(statistics.median(ts) * 1e6)

    def on_second_thread() -> float:
        out: list[float] = []
        t = threading.Thread(target=timed, args=(out,))
        t.start()
        t.join()
        return out[0]

    for r in range(args.rounds):
        first: list[float] = []
        timed(first)
        second = on_second_thread()
        again: list[float] = []
        timed(again)
        print(
            f"| {mode} | {r + 1} | {first[0]:.0f} | {second:.0f} | {again[0]:.0f} | {second / first[0]:.2f}x |"
        )


if __name__ == "__main__":
    main()
