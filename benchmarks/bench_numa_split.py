"""One CPU expert server over several NUMA nodes (``cpu-server --numa-node all``) against the
plain CPU backend with the same total threads, per MoE layer, side by side in one process.

On a multi-node host the split groups are the real nodes and their weights are placed in their
nodes' memory (``stack_slots``); the plain backend's weights sit wherever one loader thread put
them (a default ``cpu-server`` without ``--numa-node``). On a one-node host the groups are FAKE
nodes over the allowed CPUs (same memory): the table then shows only what the split costs
(per-call dispatch to the group threads, two partial sums, each group's smaller team) and not
what node-local reads gain. The "dispatch" rows use tiny widths, where compute is nothing and
the split's fixed cost shows alone.

    python benchmarks/bench_numa_split.py --slots 32 --tokens 1,4,16,64

Columns: ms = median per-layer time (interleaved repetitions, fresh routing each); GB/s = bytes
of the active experts' weights per second; split/plain = time ratio (below 1: the split wins).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cpu_expert_server import numa
from cpu_expert_server.backend import CpuExpertBackend
from cpu_expert_server.numa_backend import NumaExpertBackend


def groups_for_host(threads: int | None) -> tuple[list[numa.NodeGroup], bool]:
    """The host's nodes, or two fake ones over its CPUs; and whether they are real."""
    nodes = numa.read_nodes()
    if len(nodes) >= 2:
        return numa.plan_groups(nodes, threads), True
    cpus = nodes[0].cpus
    half = max(1, len(cpus) // 2)
    fake = [numa.Node(0, cpus[:half]), numa.Node(1, cpus[half:] or cpus)]
    return numa.plan_groups(fake, threads), False


def layer(backends, s: int, h: int, inter: int, dtype: torch.dtype, stack) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    parts13, parts2 = [], []
    for _ in range(s):
        w13 = (torch.randn(1, 2 * inter, h, generator=g) / h**0.5).to(dtype)
        w2 = (torch.randn(1, h, inter, generator=g) / inter**0.5).to(dtype)
        packed = [b.pack_weights(w13, w2) for b in backends][0]
        parts13.append(packed[0][0])
        parts2.append(packed[1][0])
    return stack(parts13, parts2)


def time_pair(plain, split, w_plain, w_split, t: int, k: int, s: int, h: int, dtype, reps: int):
    """Median seconds of plain and split forwards, alternating so drift hits both alike; and the
    mean count of distinct experts a call reads."""
    g = torch.Generator().manual_seed(t)
    times: dict[str, list[float]] = {"plain": [], "split": []}
    distinct = []
    for r in range(reps + 1):
        x = torch.randn(t, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)])  # [T, K]
        wts = torch.rand(t, k, generator=g)
        distinct.append(torch.unique(ids).numel())
        for name, b, (w13, w2) in (("plain", plain, w_plain), ("split", split, w_split)):
            t0 = time.perf_counter()
            b.forward(x, w13, w2, ids, wts)
            if r:  # the first round warms both up
                times[name].append(time.perf_counter() - t0)
    return {n: sorted(v)[len(v) // 2] for n, v in times.items()}, sum(distinct) / len(distinct)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)  # Qwen3-30B-A3B
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--slots", type=int, default=32, help="experts this server holds per layer")
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--threads", type=int, default=None, help="total (default: every allowed CPU)")
    ap.add_argument("--weight-dtype", default="bfloat16", choices=("bfloat16", "int8", "int4"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    groups, real = groups_for_host(args.threads)
    total = sum(g.threads for g in groups)
    dtype = torch.bfloat16
    print(
        f"{'real' if real else 'FAKE (one-node host: same memory)'} nodes: "
        + "; ".join(f"node {g.node}: {g.threads} threads on {numa.cpulist(g.cpus)}" for g in groups)
        + f" | plain: {total} threads | {args.weight_dtype}"
    )
    rows = []
    shapes = [("dispatch", 64, 32, [1, 4])] + [
        ("layer", args.hidden, args.inter, [int(t) for t in args.tokens.split(",")])
    ]
    for kind, h, inter, tokens in shapes:
        s = args.slots
        k = min(args.top_k, s)
        # new backends per shape: a backend serves one model (its packed format is fixed)
        split = NumaExpertBackend(groups, args.weight_dtype)
        plain = CpuExpertBackend(total, args.weight_dtype)
        w_split = layer([split, plain], s, h, inter, dtype, split.stack_slots)
        # the plain server's stacking: one loader thread, wherever it ran
        w_plain = (w_split[0].clone(), w_split[1].clone())
        per_slot = sum(w[0].numel() * w.element_size() for w in w_split)  # bytes of one expert
        for t in tokens:
            m, active = time_pair(plain, split, w_plain, w_split, t, k, s, h, dtype, args.reps)
            gbs = {n: active * per_slot / v / 1e9 for n, v in m.items()}
            row = {
                "kind": kind, "H": h, "I": inter, "S": s, "T": t, "K": k,
                "plain_ms": m["plain"] * 1e3, "split_ms": m["split"] * 1e3,
                "plain_GBs": gbs["plain"], "split_GBs": gbs["split"], "ratio": m["split"] / m["plain"],
            }  # fmt: skip
            rows.append(row)
            print(
                f"{kind:8s} H={h:5d} I={inter:4d} S={s:3d} T={t:3d} K={k}: plain {row['plain_ms']:8.3f} ms "
                f"({row['plain_GBs']:6.1f} GB/s)  split {row['split_ms']:8.3f} ms ({row['split_GBs']:6.1f} GB/s)"
                f"  split/plain {row['ratio']:.2f}",
                flush=True,
            )
        split.close()
    if args.out:
        args.out.write_text(
            json.dumps({"real_nodes": real, "groups": [g.__dict__ for g in groups], "rows": rows})
        )


if __name__ == "__main__":
    main()
