"""Few moves: rebalance starting from the live placement, moving weights only where it pays.

Per layer, with the new load: if the live placement's slowest-server time is within
``threshold`` of a from-scratch plan's, the layer stays as it is (no weights move). Otherwise
a local search (:func:`refine`) starts from the live layer and moves or swaps experts off the
slowest server until it is within ``threshold`` of the from-scratch time; a layer the search
cannot bring there takes the from-scratch plan, with its servers renamed among interchangeable
servers (same capacity and speed) to keep as many experts in place as possible.

Weights moved = (server, expert) pairs present in the new layer and absent from the old one: a
server reuses weights it already holds (the worker's prepare reads only new experts).

Shapes: L layers, E logical experts, P physical slots, S servers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from coordinator.eplb.hetero import rebalance_heterogeneous, server_times, slot_shares
from coordinator.eplb.packing import refine


@dataclass(frozen=True)
class MovePlan:
    phy2log: torch.Tensor  # [L, P]
    owner: torch.Tensor  # [L, P]
    how: torch.Tensor  # [L] int8: 0 kept as is, 1 local search from live, 2 from scratch
    moved: torch.Tensor  # [L] expert weights each layer must load
    time_live: torch.Tensor  # [L] slowest-server time of the live placement, new load
    time_scratch: torch.Tensor  # [L] slowest-server time of the from-scratch plan
    time_new: torch.Tensor  # [L] slowest-server time of this plan


def presence(phy2log: torch.Tensor, owner: torch.Tensor, num_servers: int, num_experts: int) -> torch.Tensor:
    """``[L, S, E]`` copies of expert e on server s."""
    layers = phy2log.shape[0]
    out = torch.zeros(layers, num_servers * num_experts, dtype=torch.long)
    return out.scatter_add_(1, owner * num_experts + phy2log, torch.ones_like(phy2log)).view(
        layers, num_servers, num_experts
    )


def weights_moved(
    old_phy2log: torch.Tensor,
    old_owner: torch.Tensor,
    phy2log: torch.Tensor,
    owner: torch.Tensor,
    num_servers: int,
    num_experts: int,
) -> torch.Tensor:  # [L] expert weights to load per layer
    old = presence(old_phy2log, old_owner, num_servers, num_experts) > 0
    new = presence(phy2log, owner, num_servers, num_experts) > 0
    return (new & ~old).flatten(1).sum(1)


def align_servers(
    old_phy2log: torch.Tensor,
    old_owner: torch.Tensor,
    phy2log: torch.Tensor,
    owner: torch.Tensor,
    server_class: torch.Tensor,  # [S] servers with equal class are interchangeable
    num_experts: int,
) -> torch.Tensor:  # [L, P] owner renamed to keep experts in place
    """Greedy matching of new servers to old ones by shared experts, per layer, within a class."""
    layers, s = owner.shape[0], server_class.numel()
    old = (presence(old_phy2log, old_owner, s, num_experts) > 0).double()
    new = (presence(phy2log, owner, s, num_experts) > 0).double()
    overlap = (new @ old.transpose(1, 2)).numpy()  # [L, S_new, S_old]
    cls = server_class.numpy()
    overlap[:, cls[:, None] != cls[None, :]] = -1.0
    rename = np.full((layers, s), -1, dtype=np.int64)  # new server -> old server
    rows = np.arange(layers)
    flat = overlap.reshape(layers, -1)
    for _ in range(s):
        k = flat.argmax(axis=1)
        live = flat[rows, k] >= 0
        if not live.any():
            break
        r, i, j = rows[live], k[live] // s, k[live] % s
        rename[r, i] = j
        overlap[r, i, :] = -2.0
        overlap[r, :, j] = -2.0
    assert (rename >= 0).all(), "every class maps onto itself, so the matching is complete"
    return torch.from_numpy(np.take_along_axis(rename, owner.numpy(), axis=1))


def with_replica_slots(
    weight: torch.Tensor,  # [L, E] load
    phy2log: torch.Tensor,  # [L, P] live placement
    owner: torch.Tensor,  # [L, P]
    capacity: torch.Tensor,  # [S]
    speed: torch.Tensor,  # [S]
    num_replicas: int,  # P' > P slots per layer
    base: torch.Tensor | None = None,  # [S] fixed time per layer
) -> tuple[torch.Tensor, torch.Tensor] | None:  # [L, P'] each
    """The live layers grown to ``num_replicas`` slots by adding replicas only, one slot at a
    time: the (server with room, expert it does not hold) whose replica leaves the slowest
    server fastest. Every live slot stays, so the servers load just the new replicas (a
    from-scratch plan of the new slot count re-placed nearly every expert). None where no
    server with room lacks an expert."""
    layers, p = phy2log.shape
    e, s = weight.shape[1], capacity.numel()
    rate = speed.double().clamp(min=1e-12)[:, None]  # [S, 1]
    fixed = torch.zeros(s, 1, dtype=torch.float64) if base is None else base.double()[:, None]  # [S, 1]
    out_phy, out_own = [], []
    for row in range(layers):
        phys, owns = phy2log[row].tolist(), owner[row].tolist()
        w = weight[row].double()
        held = torch.zeros(s, e, dtype=torch.float64)  # [S, E] copies of each expert per server
        held.index_put_((owner[row], phy2log[row]), torch.ones(p, dtype=torch.float64), accumulate=True)
        for _ in range(num_replicas - p):
            count = held.sum(0).clamp(min=1)  # [E]
            load = (held * (w / count)).sum(1, keepdim=True) / rate + fixed  # [S, 1] time per server
            gone = w / count - w / (count + 1)  # [E] each holder's share that moves to the replica
            after = load - held * gone / rate  # [S, E]: every server's time, per expert replicated
            best: tuple[float, int, int] | None = None
            for k in range(s):
                if int(capacity[k]) - int(held[k].sum()) <= 0:
                    continue
                cost = after.clone()
                cost[k] += w / (count + 1) / rate[k]
                worst = cost.max(0).values  # [E]
                worst[held[k] > 0] = float("inf")
                ex = int(worst.argmin())
                if float(worst[ex]) != float("inf") and (best is None or float(worst[ex]) < best[0]):
                    best = (float(worst[ex]), k, ex)
            if best is None:
                return None
            _, k, ex = best
            phys.append(ex)
            owns.append(k)
            held[k, ex] += 1
        out_phy.append(phys)
        out_own.append(owns)
    return torch.tensor(out_phy, dtype=torch.long), torch.tensor(out_own, dtype=torch.long)


def rebalance_few_moves(
    weight: torch.Tensor,  # [L, E] new load
    old_phy2log: torch.Tensor,  # [L, P] live placement
    old_owner: torch.Tensor,  # [L, P]
    capacity: torch.Tensor,  # [S]
    speed: torch.Tensor,  # [S]
    threshold: float = 0.05,
    refine_rounds: int = 32,
    max_moves: int = 0,  # expert weights the plan may load in all (0: no cap)
    base: torch.Tensor | None = None,  # [S] fixed time per layer
) -> MovePlan:
    layers, e = weight.shape
    p = old_phy2log.shape[1]
    weight = weight.double().cpu()
    phy2log, owner, _ = rebalance_heterogeneous(weight, capacity, speed, p, refine_rounds, base)
    t_live = server_times(weight, old_phy2log, old_owner, speed, base).max(1).values
    t_scratch = server_times(weight, phy2log, owner, speed, base).max(1).values
    goal = t_scratch * (1.0 + threshold)
    keep = t_live <= goal
    # local search from the live layer, replicas unchanged, until within the goal
    searched, _ = refine(
        slot_shares(weight, old_phy2log),
        old_owner,
        capacity,
        speed,
        max_rounds=4 * refine_rounds,
        target=goal,
        group=old_phy2log,
        base=base,
    )
    t_search = server_times(weight, old_phy2log, searched, speed, base).max(1).values
    use_search = ~keep & (t_search <= goal)
    scratch = ~keep & ~use_search
    classes = server_classes(capacity, speed, base)
    aligned = align_servers(old_phy2log, old_owner, phy2log, owner, classes, e)
    out_phy2log = torch.where(scratch[:, None], phy2log, old_phy2log)
    out_owner = torch.where(scratch[:, None], aligned, torch.where(use_search[:, None], searched, old_owner))
    how = torch.where(keep, 0, torch.where(use_search, 1, 2)).to(torch.int8)
    moved = weights_moved(old_phy2log, old_owner, out_phy2log, out_owner, capacity.numel(), e)
    t_new = server_times(weight, out_phy2log, out_owner, speed, base).max(1).values
    if max_moves and int(moved.sum()) > max_moves:
        kept = within_moves(t_live - t_new, moved, max_moves)
        out_phy2log = torch.where(kept[:, None], old_phy2log, out_phy2log)
        out_owner = torch.where(kept[:, None], old_owner, out_owner)
        how = torch.where(kept, 0, how).to(torch.int8)
        moved = torch.where(kept, 0, moved)
        t_new = torch.where(kept, t_live, t_new)
    return MovePlan(out_phy2log, out_owner, how, moved, t_live, t_scratch, t_new)


def server_classes(capacity: torch.Tensor, speed: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """``[S]`` the class of each server: servers of one class (same slots, speed and fixed time)
    are interchangeable, so a plan's servers may be renamed within a class."""
    cols = [capacity.double(), speed.double()] + ([] if base is None else [base.double()])
    return torch.unique(torch.stack(cols, 1), dim=0, return_inverse=True)[1]


def within_moves(gain: torch.Tensor, moved: torch.Tensor, max_moves: int) -> torch.Tensor:
    """``[L]`` bool: the layers left as they are so that at most ``max_moves`` weights move, the
    layers that gain most per weight moved taken first (a layer that does not fit the moves
    left is passed over for smaller ones)."""
    kept = torch.ones_like(moved, dtype=torch.bool)
    order = sorted(
        (row for row in range(moved.numel()) if int(moved[row]) > 0),
        key=lambda row: (-float(gain[row]) / int(moved[row]), row),
    )
    left = max_moves
    for row in order:
        if int(moved[row]) <= left:
            kept[row] = False
            left -= int(moved[row])
    kept[moved == 0] = False  # NOTE: nothing moves there, whatever it changes (a replica's slot)
    return kept
