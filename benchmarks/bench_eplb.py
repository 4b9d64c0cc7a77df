"""EPLB solve time and balance: our vectorised policies against the re-stated DeepSeek greedy.

    python benchmarks/bench_eplb.py algo [--layers 58] [--experts 256] [--reps 7]

Per configuration (Zipf 0.8 loads, expert ranks shuffled per layer): solve time of ours
(min and median over reps, one torch/numpy thread) and of the reference re-statement from
tests/test_eplb.py (pure Python, one run over all layers), and the per-layer max/mean balance:
the static placement (expert e on GPU e // (E/D), no replicas), the reference, ours.
Also: heterogeneous servers (slowest-server time against the reference's placement) and the
few-moves re-placement after a +-10% load change (weights moved, balance against scratch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.eplb import (  # noqa: E402
    rebalance_experts,
    rebalance_few_moves,
    rebalance_heterogeneous,
    server_times,
)
from tests.test_eplb import ref_gpu_loads  # noqa: E402


def zipf(layers: int, experts: int, a: float, seed: int) -> torch.Tensor:  # [L, E] token counts
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(layers)]) + 1
    return (100_000 / ranks.double() ** a).round()


def timed(fn, reps: int) -> tuple[list[float], object, float]:
    """Wall ms per run, the last result, and the least CPU ms of this process per run (on a
    shared machine wall time includes waiting for a core; CPU time does not)."""
    out = fn()  # warm-up
    ts, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        ts.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return ts, out, min(cpu)


def mm(loads: torch.Tensor) -> torch.Tensor:  # [L, D] -> [L] max / mean
    return loads.max(1).values / loads.mean(1)


def algo(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    w = zipf(args.layers, args.experts, 0.8, seed=0)
    layers, e = w.shape
    print(f"## solve time, {layers} layers x {e} experts, Zipf 0.8\n")
    print(
        "| policy | GPUs | slots | groups/nodes | ours wall min / median ms | ours CPU ms |"
        " reference wall / CPU ms | speed-up (CPU) | balance static | balance reference |"
        " balance ours (mean / worst layer) |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    configs = [  # (name, slots, groups, nodes, gpus)
        ("hierarchical", 288, 8, 4, 32),
        ("global", 288, 1, 1, 32),
        ("hierarchical", 320, 8, 4, 320),
        ("global", 320, 1, 1, 320),
    ]
    for name, slots, groups, nodes, gpus in configs:
        ts, (phy2log, _, logcnt), cpu = timed(
            lambda c=(slots, groups, nodes, gpus): rebalance_experts(w, *c), args.reps
        )
        share = (w / logcnt).gather(1, phy2log)
        ours = mm(share.view(layers, gpus, -1).sum(-1))
        t0, c0 = time.perf_counter(), time.process_time()
        ref = torch.tensor(
            [ref_gpu_loads(w[i].tolist(), slots, groups, nodes, gpus) for i in range(layers)],
            dtype=torch.float64,
        )
        t_ref, c_ref = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        static = (
            mm(w.view(layers, gpus, -1).sum(-1)) if e % gpus == 0 else torch.full((layers,), float("nan"))
        )
        worse = int((ours > mm(ref) + 1e-9).sum())
        print(
            f"| {name} | {gpus} | {slots} | {groups}/{nodes} | {min(ts):.1f} / {statistics.median(ts):.1f} | "
            f"{cpu:.1f} | {t_ref:.0f} / {c_ref:.0f} | {c_ref / cpu:.0f}x | {static.mean():.3f} | {mm(ref).mean():.4f} | "
            f"{ours.mean():.4f} / {ours.max():.4f} (layers worse than ref: {worse}) |"
        )

    print("\n## heterogeneous: 8 GPU servers (speed 8) + 24 CPU servers (speed 1), 9 slots each\n")
    speed = torch.tensor([8.0] * 8 + [1.0] * 24)
    capacity = torch.full((32,), 9)
    ts, (phy2log, owner, _), cpu = timed(lambda: rebalance_heterogeneous(w, capacity, speed, 288), args.reps)
    ours_t = server_times(w, phy2log, owner, speed).max(1).values
    ref = torch.tensor(
        [ref_gpu_loads(w[i].tolist(), 288, 1, 1, 32) for i in range(layers)], dtype=torch.float64
    )
    ref_t = (ref / speed).max(1).values
    print(
        "| solve wall min / median ms | CPU ms | slowest-server time ours / reference (mean, worst layer) |"
    )
    print("|---:|---:|---:|")
    ratio = ours_t / ref_t
    print(
        f"| {min(ts):.1f} / {statistics.median(ts):.1f} | {cpu:.1f} | {ratio.mean():.3f}, {ratio.max():.3f} |"
    )

    print("\n## few moves: live placement from the load above, then +-10% noise on every count\n")
    print(
        "| servers | threshold | solve wall min ms | CPU ms | layers kept / searched / scratch |"
        " weights moved (of slots) | worst layer time / scratch |"
    )
    print("|---|---:|---:|---:|---|---:|---:|")
    g = torch.Generator().manual_seed(1)
    changed = (w * (1 + 0.1 * (2 * torch.rand(w.shape, generator=g) - 1))).round()
    for label, sp in (("32 equal", torch.ones(32)), ("8 fast + 24 slow", speed)):
        phy2log, owner, _ = rebalance_heterogeneous(w, capacity, sp, 288)
        for thr in (0.02, 0.05):
            ts, plan, cpu = timed(
                lambda sp=sp, phy2log=phy2log, owner=owner, thr=thr: rebalance_few_moves(
                    changed, phy2log, owner, capacity, sp, threshold=thr
                ),
                max(1, args.reps // 2),
            )
            how = torch.bincount(plan.how.long(), minlength=3).tolist()
            print(
                f"| {label} | {thr} | {min(ts):.1f} | {cpu:.1f} | {how[0]} / {how[1]} / {how[2]} | "
                f"{int(plan.moved.sum())} ({plan.moved.sum() / (layers * 288):.1%}) | "
                f"{(plan.time_new / plan.time_scratch).max():.4f} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["algo"], nargs="?", default="algo")
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    algo(args)


if __name__ == "__main__":
    main()
