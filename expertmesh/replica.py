"""``load_aware`` replica choice: per step, each token of a replicated expert goes to the
replica whose server is least loaded in that step.

Vectorised over tokens and experts, no per-token or per-expert Python loop:

1. Base load of each server: the step's tokens of experts that have a single replica (they
   have no choice), plus the other replicated experts' tokens as if split evenly over their
   replicas, in time units when server speeds are given.
2. Each expert's tokens are water-filled over its replicas' servers: replica ``r`` gets
   ``x_r = max(0, (lam - b_r) * v_r)`` with ``sum_r x_r = n_e`` (``b`` base time, ``v``
   speed), i.e. tokens go to the least loaded servers first until their times meet. All
   experts are filled at once against that base (one vectorised pass, not a sequential fill),
   so each would make up the whole imbalance on its own: expert ``e`` moves only its share
   ``n_e / N`` of the way from the even split to its fill (``N``: tokens of the replicated
   experts on its busiest server), so experts sharing servers do not overshoot together.
3. Integer quotas by rounding the running sums, then the ``q``-th token of expert ``e`` (in
   token order) takes the replica whose quota range holds ``q``.

Shapes: T tokens, K top-k, E logical experts, R max replicas, P physical slots, S servers.
"""

from __future__ import annotations

import torch


def choose_load_aware(
    topk_ids: torch.Tensor,  # [T, K] logical expert ids
    log2phy: torch.Tensor,  # [E, R] physical slots, -1 padded
    logcnt: torch.Tensor,  # [E] replicas per expert (>= 1)
    owner: torch.Tensor,  # [P] server of each physical slot
    num_servers: int,
    speed: torch.Tensor | None = None,  # [S] tokens per unit time; None = equal
) -> torch.Tensor:  # [T, K] physical slot ids
    e, r = log2phy.shape
    ids = topk_ids.flatten()  # [T*K]
    n = torch.zeros(e, dtype=torch.float64).index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.float64))
    v_srv = torch.ones(num_servers, dtype=torch.float64) if speed is None else speed.double()
    single = logcnt == 1  # [E]
    first_owner = owner[log2phy[:, 0]]  # [E]
    valid = log2phy >= 0  # [E, R]
    srv = owner[log2phy.clamp(min=0)]  # [E, R]
    even = torch.where(valid & ~single[:, None], (n / logcnt)[:, None], 0.0)  # [E, R]
    base = torch.zeros(num_servers, dtype=torch.float64).index_add_(0, first_owner, n * single)
    base.index_add_(0, srv.flatten(), even.flatten())
    # each expert sees the base without its own even split: [E, R] time units
    own = torch.zeros(e, num_servers, dtype=torch.float64).scatter_add_(1, srv, even)  # [E, S]
    b = torch.where(valid, (base[srv] - own.gather(1, srv)) / v_srv[srv], torch.inf)  # [E, R]
    v = torch.where(valid, v_srv[srv], 0.0)
    # water level: sort replicas by base time; level_j using the j cheapest replicas
    b_sorted, order = b.sort(dim=1)
    v_sorted = v.gather(1, order)
    bv = torch.where(torch.isfinite(b_sorted), b_sorted * v_sorted, 0.0)
    level = (n[:, None] + bv.cumsum(1)) / v_sorted.cumsum(1).clamp(min=1e-300)  # [E, R]
    # the level is right for the largest j whose own base is below it
    usable = (b_sorted < level) & torch.isfinite(b_sorted)
    j = (usable.cumsum(1) * usable).argmax(dim=1, keepdim=True)  # [E, 1] last usable
    lam = level.gather(1, j)  # [E, 1]
    x = torch.where(valid, ((lam - b) * v).clamp(min=0.0), 0.0)  # [E, R] replica order
    rep_n = torch.where(valid & ~single[:, None], n[:, None], 0.0)  # [E, R]
    shared = torch.zeros(num_servers, dtype=torch.float64).index_add_(0, srv.flatten(), rep_n.flatten())
    alpha = n / torch.where(valid, shared[srv], 0.0).amax(1).clamp(min=1.0)  # [E]
    even_all = torch.where(valid, (n / logcnt)[:, None], 0.0)
    x = even_all + alpha[:, None] * (x - even_all)
    bound = torch.round(x.cumsum(1))  # [E, R] cumulative integer quotas
    bound[:, -1] = n  # rounding never loses a token
    bound = torch.minimum(bound, n[:, None])
    # rank of each (token, k) among the tokens of its expert, in token order
    sorted_ids, perm = ids.sort(stable=True)
    start = torch.cumsum(n, 0) - n  # [E]
    rank = torch.empty_like(ids)
    rank[perm] = torch.arange(ids.numel()) - start.long()[sorted_ids]
    pick = (bound[ids] <= rank[:, None].double()).sum(1)  # [T*K] replica index
    pick = torch.minimum(pick, logcnt[ids] - 1)
    return log2phy[ids, pick].view_as(topk_ids)
