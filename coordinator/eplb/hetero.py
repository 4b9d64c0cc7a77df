"""Rebalancing for unequal servers: each server has a slot capacity and a measured speed.

DeepSeek's greedy balances token counts over equal GPUs. Here a GPU expert server may be many
times faster per token than a CPU one, and servers hold different numbers of slots, so the
objective is the slowest server's time per layer: ``max_s base_s + load_s / speed_s``, where
``1 / speed_s`` is a server's measured time per token and ``base_s`` its time per layer that
does not grow with tokens (coordinator/eplb/time_model.py fits both; ``base`` None = 0, the
proportional model). Replication is
the same divisor rule (the hottest experts get the extra slots); packing puts each physical
expert, heaviest first, on the server where it finishes soonest among those with a free slot,
then :func:`refine` moves or swaps experts off the slowest server. An expert gets at most one
replica per server.

Tokens of a replicated expert are modelled as split evenly over its replicas (what ``static``
round robin does; ``load_aware`` does at least as well).

Shapes: L layers, E logical experts, P physical slots, S servers.
"""

from __future__ import annotations

import torch

from coordinator.eplb.packing import greedy_pack, refine
from coordinator.eplb.replicate import replicate_experts


def logcnt_of(phy2log: torch.Tensor, num_experts: int) -> torch.Tensor:  # [L, E] replicas per expert
    return torch.zeros(phy2log.shape[0], num_experts, dtype=torch.long).scatter_add_(
        1, phy2log, torch.ones_like(phy2log)
    )


def slot_shares(weight: torch.Tensor, phy2log: torch.Tensor) -> torch.Tensor:  # [L, P] float64
    """Tokens each physical slot serves: its expert's load over the expert's replica count."""
    cnt = logcnt_of(phy2log, weight.shape[1]).clamp(min=1)
    return (weight.double() / cnt).gather(1, phy2log)


def server_times(
    weight: torch.Tensor,  # [L, E]
    phy2log: torch.Tensor,  # [L, P]
    owner: torch.Tensor,  # [L, P] server of each slot
    speed: torch.Tensor,  # [S] tokens per unit time
    base: torch.Tensor | None = None,  # [S] fixed time per layer, whatever a server computes
) -> torch.Tensor:  # [L, S] time per layer
    share = slot_shares(weight, phy2log)
    load = torch.zeros(owner.shape[0], speed.numel(), dtype=torch.float64).scatter_add_(1, owner, share)
    t = load / speed.double()
    return t if base is None else t + base.double()


def rebalance_heterogeneous(
    weight: torch.Tensor,  # [L, E]
    capacity: torch.Tensor,  # [S] int64 slots per layer each server can hold
    speed: torch.Tensor,  # [S] tokens per unit time (relative is enough)
    num_replicas: int,
    refine_rounds: int = 32,
    base: torch.Tensor | None = None,  # [S] fixed time per layer (a server's time: base + load / speed)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # phy2log [L, P], owner [L, P], logcnt [L, E]
    """Replicate to ``num_replicas`` slots, then pack onto servers by finish time."""
    assert int(capacity.sum()) >= num_replicas, f"{num_replicas=} > total capacity {capacity.tolist()}"
    assert bool((speed > 0).all()), f"speeds must be positive: {speed.tolist()}"
    weight = weight.double().cpu()
    phy2log, _, logcnt = replicate_experts(weight, num_replicas, max_count=capacity.numel())
    share = (weight / logcnt).gather(1, phy2log)  # [L, P]
    # NOTE: two replicas of one expert on one server are modelled exactly (that server serves
    # both shares); the local search creates no new such pairs (a slot would be wasted)
    owner = greedy_pack(share, capacity, speed, base)
    if refine_rounds:
        owner, _ = refine(share, owner, capacity, speed, max_rounds=refine_rounds, group=phy2log, base=base)
    return phy2log, owner, logcnt
