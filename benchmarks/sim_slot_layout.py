"""What an expert server's commits would write over a chain of EPLB rebalances, at any model
size, without a GPU: the coordinator's own planner (coordinator/eplb/plan.py) on drifting
synthetic expert loads, each server's change laid out by the worker's own budget
(expertmesh/worker/budget.py), counted in slots (one expert's weights).

Per rebalance and server: tables resized, the slots that change (moved or read), live slots
the commit writes (moves and reads of live slots, every slot of a layer rebuilt in the commit),
the same where every resized table is rebuilt whole in the commit (tables of exact size),
layers rebuilt in the commit, slots the prepare writes beside serving (new allocations,
experts read ahead, spare slots), the most slots held beyond the allocations held before the
change (a server that grows holds its new experts too), and the spare slots held afterwards.

    python benchmarks/sim_slot_layout.py --layers 48 --experts 128 --gpu-experts 96
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.eplb.plan import EplbConfig, plan_rebalance  # noqa: E402
from expertmesh import placement as pl  # noqa: E402
from expertmesh.worker.budget import _peak, headroom, plan_change  # noqa: E402
from expertmesh.worker.moves import plan_layer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--gpu-experts", type=int, default=96, help="the static split's first placement")
    p.add_argument("--speeds", default="4,1", help="GPU server, CPU server: tokens per unit time")
    p.add_argument("--redundant", type=int, default=2)
    p.add_argument("--rebalances", type=int, default=12)
    p.add_argument("--drift", type=float, default=0.3, help="log-normal sigma of each window's load")
    p.add_argument("--spare", type=float, default=0.5, help="spare slots kept, as a share of the budget")
    args = p.parse_args()

    layers, e = list(range(args.layers)), args.experts
    live = pl.static_split(layers, e, ["gpu0"], ["cpu0"], args.gpu_experts)
    speed = torch.tensor([float(x) for x in args.speeds.split(",")], dtype=torch.float64)
    cap = torch.tensor([e, e])  # each server's default --capacity: the expert count
    cfg = EplbConfig(redundant_slots=args.redundant, skip_threshold=0.0, move_threshold=0.0)
    g = torch.Generator().manual_seed(0)
    base = torch.rand(len(layers), e, generator=g) ** 3 * 1000  # [L, E] skewed, per layer
    budget = e  # one layer of slots (capacity) per server
    spare = int(budget * args.spare)
    tables = [live.server_slots(s) for s in range(2)]
    alloc = [{la: headroom(spare, len(layers), e, len(t[la])) for la in layers} for t in tables]

    print(f"{args.layers} layers x {e} experts; budget {budget} slots per server, spare {spare}")
    print(
        "| rebalance | server | resized | slots changed | commit writes | exact tables: commit writes "
        "| rebuilt in commit | prepare writes | peak extra | spare |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for step in range(1, args.rebalances + 1):
        noise = torch.exp(torch.randn(len(layers), e, generator=g) * args.drift)
        plan = plan_rebalance((base * noise).round().double(), live, layers, cap, speed, cfg, expert_bytes=1)
        if plan.placement is None:
            continue
        live = plan.placement
        for s, name in enumerate(live.servers):
            new = live.server_slots(s)
            lay = plan_change(tables[s], alloc[s], {la: tuple(v) for la, v in new.items()}, e, budget, spare)
            commit = rebuilt = prepare = resized = changed = whole = 0
            for la in layers:
                pln = lay.plans[la]
                resized += pln.resize
                in_place = plan_layer(tables[s][la], tuple(new[la]))
                changed += len(in_place.moves) + len(in_place.reads)
                whole += len(new[la]) if in_place.resize else len(in_place.moves) + len(in_place.reads)
                if la in lay.built:
                    prepare += pln.rebuild or 0
                elif pln.rebuild is not None:
                    commit += len(pln.experts)
                    rebuilt += 1
                else:
                    writes = [d for d, _ in (*pln.moves, *pln.reads)]
                    commit += sum((la, d) not in lay.direct for d in writes)
                    prepare += sum((la, d) in lay.direct or (la, d) in lay.staged for d in writes)
            peak = _peak(lay.plans, alloc[s], set(lay.built), set(lay.loads), set(lay.staged))
            for la in layers:
                r = lay.plans[la].rebuild
                alloc[s][la] = alloc[s][la] if r is None else r
            tables[s] = {la: tuple(v) for la, v in new.items()}
            held = sum(alloc[s][la] - len(tables[s][la]) for la in layers)
            cols = (step, name, resized, changed, commit, whole, rebuilt, prepare, peak, held)
            print("| " + " | ".join(map(str, cols)) + " |")


if __name__ == "__main__":
    main()
