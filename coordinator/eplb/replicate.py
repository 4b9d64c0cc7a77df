"""Replication: which logical experts get the redundant physical slots.

DeepSeek EPLB's ``replicate_experts`` hands out the redundant slots one at a time, each to the
expert whose load per replica is highest right now. That sequence is the divisor (D'Hondt)
apportionment: the ``c``-th extra replica of expert ``e`` is granted at priority ``w_e / c``,
and the first ``X`` grants are exactly the ``X`` largest priorities. So instead of ``X``
sequential argmax steps we find the ``X``-th largest priority once per row; among equal
priorities the lower expert id wins, as a first-index argmax would.

Candidate depth: with ``W`` the row's total, at least ``X`` priorities are >= W / (X + E), so
expert ``e`` gets at most ``w_e (X + E) / W`` extra replicas; only that many candidates per
expert are materialised.

Shapes: B rows, E logical experts, P physical slots (P >= E), X = P - E redundant slots.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def replica_counts(
    weight: torch.Tensor, num_phy: int, max_count: int | None = None
) -> torch.Tensor:  # [B, E] int64 >= 1
    """Replicas per expert after granting ``num_phy - E`` redundant slots by highest load per
    replica (``weight`` [B, E]); with ``max_count`` no expert gets more replicas than that
    (e.g. the number of servers) while others can still take one."""
    b, e = weight.shape
    x = num_phy - e
    assert x >= 0, f"{num_phy=} < {e=} experts"
    if x == 0:
        return torch.ones(b, e, dtype=torch.long)
    w = weight.detach().cpu().double().numpy()
    total = w.sum(axis=1)
    share = float((w.max(axis=1) / np.maximum(total, 1e-300)).max()) if total.min() > 0 else 1.0
    depth = min(x, math.floor(share * (x + e)) + 1)
    if max_count is not None and e * (max_count - 1) >= x:
        depth = min(depth, max_count - 1)
    prio = (w[:, :, None] / np.arange(1, depth + 1)).reshape(b, -1)  # [B, E*depth], expert-major
    tau = -np.partition(-prio, x - 1, axis=1)[:, x - 1 : x]  # [B, 1] the X-th largest
    above = prio > tau
    tied = prio == tau
    room = x - above.sum(axis=1, keepdims=True)  # [B, 1] grants left for the tied priorities
    if (tied.sum(axis=1, keepdims=True) == room).all():
        take = above | tied
    else:
        take = above | (tied & (np.cumsum(tied, axis=1) <= room))
    return torch.from_numpy(1 + take.reshape(b, e, depth).sum(axis=-1).astype(np.int64))


def replicate_experts(
    weight: torch.Tensor,  # [B, E]
    num_phy: int,
    max_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``phy2log [B, P]`` (expert of each physical slot: every expert once in id
    order, then the extra replicas, rank by rank), ``rank [B, P]`` (replica index of the slot)
    and ``logcnt [B, E]``."""
    b, e = weight.shape
    cnt = replica_counts(weight, num_phy, max_count)
    phy2log = torch.repeat_interleave(torch.arange(e).repeat(b), cnt.flatten()).view(b, num_phy)
    start = torch.cumsum(cnt, dim=1) - cnt  # [B, E] first slot of each run of equal ids
    rank = torch.arange(num_phy)[None, :] - start.gather(1, phy2log)  # [B, P]
    order = (rank * e + phy2log).argsort(dim=1)  # rank-major, then expert id
    return phy2log.gather(1, order), rank.gather(1, order), cnt
