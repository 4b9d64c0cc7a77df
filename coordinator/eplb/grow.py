"""A server that joined the pool gets replicas first.

An expert server found at run time (coordinator/experts/membership.py), or one that came back
after its experts were re-placed on the others, holds no slot. The first placement that gives
it experts only *adds* slots there: copies of the experts with the most load per replica, every
other server's slots kept as they are. Nothing moves away from a server, so no request depends
on the new server until it holds its copies (the push's prepare loads them beside the live
set; the commit makes them routable), and no server has to load anything. The periodic EPLB
plans from there (coordinator/eplb/plan.py) and may then move experts.

How many copies: the mean slots per layer of the servers that already hold some (its share of
a balanced pool), at most its capacity and at most one copy of each expert.

Pure: no gRPC, no threads. Shapes: L MoE layers, E logical experts, S servers.
"""

from __future__ import annotations

import math
import time

import torch

from coordinator.eplb.plan import RebalancePlan, layer_metrics
from expertmesh import placement as pl


def with_servers(p: pl.Placement, servers: tuple[str, ...]) -> pl.Placement:
    """``p`` over ``servers`` (``p.servers`` followed by servers that hold no slot), same
    generation: a placement from before some servers joined, over the grown list."""
    if servers[: len(p.servers)] != p.servers:
        raise ValueError(f"servers {servers} do not extend {p.servers}")
    return pl.Placement(p.generation, servers, p.num_experts, p.layers)


def grow_placement(
    live: pl.Placement,
    moe_layers: list[int],
    joining: list[int],  # servers that hold no slot in ``live``
    capacity: torch.Tensor,  # [S] slots per layer each server accepts
    weight: torch.Tensor | None = None,  # [L, E] tokens per logical expert; None = uniform
) -> pl.Placement:
    """``live`` plus, on each server of ``joining``, copies of the experts with the most load
    per replica (greedy, replica counts updated as copies are added); generation ``live + 1``."""
    e = live.num_experts
    for i in joining:
        if any(live.server_slots(i).values()):
            raise ValueError(f"{live.servers[i]} holds slots already: it is not joining")
    per_layer: dict[int, dict[str, list[int]]] = {}
    for row, layer in enumerate(moe_layers):
        lp = live.layers[layer]
        lists = {name: lp.server_experts(s) for s, name in enumerate(live.servers)}
        holding = sum(1 for v in lists.values() if v) or 1
        share = math.ceil(len(lp.phy2log) / holding)
        w = torch.ones(e, dtype=torch.float64) if weight is None else weight[row].double()
        if float(w.sum()) <= 0:
            w = torch.ones(e, dtype=torch.float64)  # no load measured yet: spread copies evenly
        cnt = torch.tensor(lp.logcnt(e), dtype=torch.float64)  # [E]
        for s in joining:
            n = min(int(capacity[s]), e, share)
            held = torch.zeros(e, dtype=torch.bool)
            for _ in range(n):
                per_copy = torch.where(held, -1.0, w / cnt)  # [E]
                best = int(per_copy.argmax())  # NOTE: ties go to the lowest expert id
                held[best] = True
                cnt[best] += 1
            lists[live.servers[s]] = torch.nonzero(held).flatten().tolist()
        per_layer[layer] = lists
    return pl.from_server_lists(live.generation + 1, live.servers, e, per_layer)


def plan_grow(
    weight: torch.Tensor,  # [L, E]
    live: pl.Placement,
    moe_layers: list[int],
    joining: list[int],
    capacity: torch.Tensor,  # [S]
    speed: torch.Tensor,  # [S] tokens per unit time
    expert_bytes: int,
    base: torch.Tensor | None = None,  # [S] fixed time per layer (the reported times only)
) -> RebalancePlan:
    """:func:`grow_placement` as an EPLB plan (never skipped: the joined servers idle otherwise)."""
    t0 = time.perf_counter()
    weight = weight.double().cpu()
    new = grow_placement(live, moe_layers, joining, capacity, weight)
    added = sum(len(new.layers[layer].phy2log) - len(live.layers[layer].phy2log) for layer in moe_layers)
    bal_before, t_before = layer_metrics(weight, live, moe_layers, speed, base)
    bal_after, t_after = layer_metrics(weight, new, moe_layers, speed, base)
    names = ", ".join(live.servers[i] for i in joining)
    return RebalancePlan(
        placement=new,
        skipped=False,
        reason=f"{names} joined: copies of the hottest experts added there, none moved",
        token_balance_before=float(bal_before.mean()),
        token_balance_after=float(bal_after.mean()),
        time_before=float(t_before.sum()),
        time_after=float(t_after.sum()),
        weights_moved=added,
        bytes_moved=added * expert_bytes,
        compute_ms=(time.perf_counter() - t0) * 1e3,
        layers_kept=0,
        layers_searched=0,
        layers_scratch=0,
    )
