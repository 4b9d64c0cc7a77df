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

import numpy as np
import torch

_ABSENT = 1e30  # base time of a replica slot an expert does not have


def choose_load_aware(
    topk_ids: torch.Tensor,  # [T, K] logical expert ids
    log2phy: torch.Tensor,  # [E, R] physical slots, -1 padded
    logcnt: torch.Tensor,  # [E] replicas per expert (>= 1)
    owner: torch.Tensor,  # [P] server of each physical slot
    num_servers: int,
    speed: torch.Tensor | None = None,  # [S] tokens per unit time; None = equal
) -> torch.Tensor:  # [T, K] physical slot ids
    """See the module docstring. CPU tensors (the dispatcher routes on the host); the math runs
    in numpy, whose per-call cost on these tiny arrays is a fraction of torch's."""
    l2p, cnt, own_of = log2phy.numpy(), logcnt.numpy(), owner.numpy()
    ids = topk_ids.reshape(-1).numpy()  # [T*K]
    if cnt.max() <= 1:  # no replicas: nothing to choose
        return torch.from_numpy(l2p[ids, 0]).view_as(topk_ids)
    e = l2p.shape[0]
    n_all = np.bincount(ids, minlength=e).astype(np.float64)  # [E]
    v_srv = np.ones(num_servers) if speed is None else speed.double().numpy()
    single = cnt == 1
    base = np.bincount(own_of[l2p[:, 0]], weights=n_all * single, minlength=num_servers)  # [S]
    # from here on only the replicated experts: rows [X] of the [E, R] tables
    rep = np.flatnonzero(~single)
    n, c, slots = n_all[rep], cnt[rep], l2p[rep]  # [X], [X], [X, R]
    valid = slots >= 0
    srv = own_of[np.where(valid, slots, 0)]  # [X, R]
    even = np.where(valid, (n / c)[:, None], 0.0)  # [X, R]
    base = base + np.bincount(srv.ravel(), weights=even.ravel(), minlength=num_servers)
    # each expert sees the base without its own even split (replicas sharing a server count twice)
    same = (srv[:, :, None] == srv[:, None, :]) & valid[:, None, :]  # [X, R, R]
    own = same.sum(axis=2) * even  # [X, R]
    # NOTE: a missing replica gets a huge finite base time: it sorts last, is never filled
    b = np.where(valid, (base[srv] - own) / v_srv[srv], _ABSENT)
    v = np.where(valid, v_srv[srv], 0.0)
    # water level: replicas by base time; level_j uses the j cheapest ones
    order = np.argsort(b, axis=1, kind="stable")
    b_sorted, v_sorted = np.take_along_axis(b, order, axis=1), np.take_along_axis(v, order, axis=1)
    level = (n[:, None] + np.cumsum(b_sorted * v_sorted, axis=1)) / np.maximum(
        np.cumsum(v_sorted, axis=1), 1e-300
    )
    usable = b_sorted < level  # [X, R]; the level is right for the last usable j
    j = (np.cumsum(usable, axis=1) * usable).argmax(axis=1)[:, None]
    lam = np.take_along_axis(level, j, axis=1)  # [X, 1]
    x = np.where(valid, np.maximum((lam - b) * v, 0.0), 0.0)  # [X, R] replica order
    shared = np.bincount(srv.ravel(), weights=np.where(valid, n[:, None], 0.0).ravel(), minlength=num_servers)
    alpha = n / np.maximum(np.where(valid, shared[srv], 0.0).max(axis=1), 1.0)  # [X]
    x = even + alpha[:, None] * (x - even)
    bound = np.full((e, l2p.shape[1]), np.inf)  # [E, R] cumulative integer quotas
    bound[:, 0] = n_all  # single-replica experts: everything to replica 0
    q = np.minimum(np.round(np.cumsum(x, axis=1)), n[:, None])
    q[:, -1] = n  # rounding never loses a token
    bound[rep] = q
    # rank of each (token, k) among the tokens of its expert, in token order
    perm = np.argsort(ids, kind="stable")
    start = (np.cumsum(n_all) - n_all).astype(np.int64)  # [E]
    rank = np.empty_like(ids)
    rank[perm] = np.arange(ids.size) - start[ids[perm]]
    pick = np.minimum((bound[ids] <= rank[:, None]).sum(axis=1), cnt[ids] - 1)  # [T*K]
    return torch.from_numpy(l2p[ids, pick]).view_as(topk_ids)
