"""EPLB solve time and balance: our vectorised policies against the re-stated DeepSeek greedy;
and end to end on the demo model with two CPU expert servers.

    python benchmarks/bench_eplb.py algo [--layers 58] [--experts 256] [--reps 7]
    python benchmarks/bench_eplb.py e2e [--rounds 3] [--interval 8]

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


def e2e(args: argparse.Namespace) -> None:
    """Demo model, two CPU expert servers (static split: experts 0-7 | 8-15), greedy requests in
    concurrent rounds. Run A: no rebalancing. Run B: EPLB every ``interval`` steps with 2
    redundant slots per server. Reports per-server token max/mean per layer over the load
    window, median step time, and the worst step that overlapped a rebalance."""
    import asyncio
    import tempfile

    import grpc

    from coordinator.eplb.plan import EplbConfig
    from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
    from coordinator.serving.server import CoordinatorConfig
    from expertmesh.client import AsyncClient
    from expertmesh.demo import write_demo_model
    from expertmesh.v1 import admin_pb2, admin_pb2_grpc
    from tests.cluster_utils import start_server
    from tests.serving_utils import ServerThread
    from tests.test_serving_cluster import wait_health

    torch.set_num_threads(1)
    prompts = [f"the {w} of the" for w in ("cat", "dog", "model", "expert", "server", "king", "sea", "word")]
    prompts = prompts * 2

    async def load(addr: str) -> None:
        async with AsyncClient(addr) as c:
            for _ in range(args.rounds):
                await asyncio.gather(*(c.generate(p, max_new_tokens=32, ignore_eos=True) for p in prompts))

    def run(path, procs, eplb: EplbConfig) -> dict:
        specs = tuple(ServerSpec(f"cpu{i}", p.address, "cpu") for i, p in enumerate(procs))
        cfg = CoordinatorConfig(
            model_dir=str(path),
            port=0,
            max_batch_tokens=64,
            max_running=16,
            cluster=ClusterConfig(specs, replica_policy=args.replica_policy),
            eplb=eplb,
        )
        steps: list[tuple[float, float]] = []  # (start, seconds)
        with ServerThread(cfg) as s:
            wait_health(s.addr, "SERVING")
            engine = s.scheduler.engine
            inner = engine.step

            def timed_step(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return inner(*a, **kw)
                finally:
                    steps.append((time.time(), time.perf_counter() - t0))

            engine.step = timed_step
            asyncio.run(load(s.addr))
            with grpc.insecure_channel(s.addr) as ch:
                stub = admin_pb2_grpc.AdminStub(ch)
                ld = stub.GetExpertLoad(admin_pb2.GetExpertLoadRequest())
                st = stub.GetEplbStatus(admin_pb2.GetEplbStatusRequest())
        per = torch.tensor([list(x.window_tokens) for x in ld.servers], dtype=torch.float64)  # [S, L]
        balance = per.max(0).values / per.mean(0)
        return dict(steps=steps, balance=balance, status=st)

    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_model(Path(tmp) / "model")
        procs = [start_server("cpu", path, 0, "--threads", "1") for _ in range(2)]
        on = EplbConfig(
            interval_steps=args.interval, window_steps=args.window, redundant_slots=2, skip_threshold=0.02
        )
        off = EplbConfig(interval_steps=0, window_steps=args.window)
        runs: list[tuple[str, dict]] = []
        try:
            # NOTE: A and B alternate (``--pairs`` times): on a shared machine the load drifts
            for i in range(args.pairs):
                runs.append((f"A{i + 1}: static placement", run(path, procs, off)))
                runs.append((f"B{i + 1}: EPLB every {args.interval} steps", run(path, procs, on)))
        finally:
            for p in procs:
                p.stop()
    print(
        f"## e2e: demo model, 2 CPU expert servers, {len(prompts)} concurrent greedy requests x 32 tokens, "
        f"{args.rounds} rounds, replica policy {args.replica_policy}\n"
    )
    print("| run | per-server tokens max/mean per layer (window) | median step ms | steps |")
    print("|---|---|---:|---:|")
    for name, r in runs:
        med = statistics.median(d for _, d in r["steps"]) * 1e3
        bal = ", ".join(f"{x:.3f}" for x in r["balance"].tolist())
        print(f"| {name} | {bal} | {med:.2f} | {len(r['steps'])} |")
    for name, b in runs:
        if name.startswith("B"):
            hiccups(name, b)


def hiccups(name: str, b: dict) -> None:
    st = b["status"]
    print(f"\n{name}: rebalanced {st.rebalanced}, skipped {st.skipped}, failed {st.failed}")
    med_b = statistics.median(d for _, d in b["steps"])
    worst = 0.0
    for o in st.history:
        if o.outcome != "rebalanced":
            continue
        begin = o.unix_time - (o.compute_ms + o.prepare_ms + o.commit_ms) / 1e3
        during = [d for t, d in b["steps"] if t >= begin and t - d <= o.unix_time]
        worst = max([worst, *during])
        print(
            f"- gen {o.generation}: token max/mean {o.token_balance_before:.3f} -> {o.token_balance_after:.3f}, "
            f"{o.weights_moved} weights, plan {o.compute_ms:.1f} ms, prepare {o.prepare_ms:.1f} ms, "
            f"commit {o.commit_ms:.1f} ms, {len(during)} steps overlapped, worst {max(during, default=0) * 1e3:.2f} ms"
        )
    print(
        f"\nworst step during a rebalance: {worst * 1e3:.2f} ms = {worst / med_b:.2f}x the median step of run B"
    )


def replica_choice(args: argparse.Namespace) -> None:
    """Per-layer cost of the replica policies on the dispatch path (CPU time of this process)."""
    from expertmesh import placement as pl

    torch.set_num_threads(1)
    e, servers, k = 128, 2, 8
    lists = {f"s{s}": list(range(s * e // servers, (s + 1) * e // servers)) for s in range(servers)}
    for s in range(servers):  # 4 hot experts of each server replicated on the other
        lists[f"s{(s + 1) % servers}"] += list(range(s * e // servers, s * e // servers + 4))
    tables = pl.from_server_lists(1, tuple(lists), e, {0: lists}).tables[0]
    print(f"\n## replica choice per MoE layer: {e} experts, top-{k}, {servers} servers, 8 replicated\n")
    print("| tokens | static us | round_robin us | load_aware us |")
    print("|---:|---:|---:|---:|")
    for t in (1, 8, 64, 512):
        ids = torch.randint(0, e, (t, k))
        row = []
        for policy in ("static", "round_robin", "load_aware"):
            pl.choose_replicas(ids, tables, policy)
            c0 = time.process_time()
            for _ in range(200):
                pl.choose_replicas(ids, tables, policy)
            row.append((time.process_time() - c0) / 200 * 1e6)
        print(f"| {t} | " + " | ".join(f"{x:.0f}" for x in row) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["algo", "e2e"], nargs="?", default="algo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--replica-policy", default="load_aware")
    ap.add_argument("--pairs", type=int, default=2, help="e2e: alternating (A, B) runs")
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if args.part == "algo":
        algo(args)
        replica_choice(args)
    else:
        e2e(args)


if __name__ == "__main__":
    main()
