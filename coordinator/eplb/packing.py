"""Packing weighted items into capacity-limited packs, batched over rows (layers, nodes).

The greedy is the longest-processing-time rule with a per-pack item limit: items in decreasing
weight, each into the pack where it finishes soonest among packs that still have room. With
equal speeds and an item limit of N/M per pack this is DeepSeek EPLB's ``balanced_packing``.
:func:`refine` then improves any assignment by single moves and pairwise swaps that lower the
slowest pack; it never makes the slowest pack slower, so greedy + refine is never worse than
the greedy alone.

The only Python loops run over items (greedy) or refinement rounds, never over rows: one
iteration is a handful of array ops on ``[B, M]``. The loops use numpy: its per-call overhead
is a few times lower than torch's on tiny arrays, and these loops are pure overhead.

Shapes: B rows (independent problems, e.g. layers), N items per row, M packs, C max items of
one pack.
"""

from __future__ import annotations

import numpy as np
import torch

_INF = np.inf


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().double().numpy()


def greedy_pack(
    weight: torch.Tensor,  # [B, N] item weights (token counts), >= 0
    capacity: torch.Tensor,  # [M] int64 max items per pack
    speed: torch.Tensor | None = None,  # [M] work per unit time; None = all equal
    base: torch.Tensor | None = None,  # [M] fixed time of each pack, whatever it holds; None = 0
) -> torch.Tensor:  # [B, N] int64 pack of each item
    """Longest-processing-time greedy with per-pack item limits (see module docstring); a pack's
    time is ``base + load / speed``."""
    b, n = weight.shape
    m = capacity.numel()
    cap = capacity.cpu().numpy().astype(np.int64)
    assert int(cap.sum()) >= n, f"{n} items do not fit packs of capacity {cap.tolist()}"
    if m == n and (cap == 1).all() and speed is None and base is None:
        return torch.arange(n).expand(b, n).clone()  # one item per pack: any order is optimal
    w = _np(weight)
    order = np.argsort(-w, axis=1, kind="stable")  # [B, N]
    w_sorted = np.take_along_axis(w, order, axis=1)
    fixed = np.zeros(m) if base is None else _np(base)  # [M]
    inv = None  # [M]; None: equal speeds and no fixed times, the score kept incrementally
    if speed is not None or base is not None:
        inv = np.ones(m) if speed is None else 1.0 / _np(speed)
    load = np.zeros((b, m))  # [B, M]
    left = np.tile(cap, (b, 1))  # [B, M] free places
    score = np.zeros((b, m))  # [B, M] equal speeds: load, inf where full
    flat_load, flat_left, flat_score = load.reshape(-1), left.reshape(-1), score.reshape(-1)
    row0 = np.arange(b) * m  # flat index of each row's first pack
    pack_sorted = np.empty((b, n), dtype=np.int64)
    for i in range(n):
        wi = w_sorted[:, i]  # [B]
        if inv is None:
            p = score.argmin(axis=1)
        else:
            p = np.where(left > 0, (load + wi[:, None]) * inv + fixed, _INF).argmin(axis=1)
        pack_sorted[:, i] = p
        k = row0 + p
        flat_load[k] += wi
        flat_left[k] -= 1
        if inv is None:
            flat_score[k] = np.where(flat_left[k] > 0, flat_load[k], _INF)
    out = np.empty_like(pack_sorted)
    np.put_along_axis(out, order, pack_sorted, axis=1)
    return torch.from_numpy(out)


def pack_loads(
    weight: torch.Tensor,  # [B, N]
    pack: torch.Tensor,  # [B, N] int64
    num_packs: int,
) -> torch.Tensor:  # [B, M] float64 summed weight per pack
    out = torch.zeros(weight.shape[0], num_packs, dtype=torch.float64)
    return out.scatter_add_(1, pack, weight.double())


def rank_in_pack(pack: torch.Tensor, num_packs: int) -> torch.Tensor:  # [B, N] 0..count-1
    """Position of each item inside its pack (items of one pack numbered in item order)."""
    b, n = pack.shape
    order = (pack * n + torch.arange(n)).argsort(dim=1)  # [B, N] items grouped by pack
    count = torch.zeros(b, num_packs, dtype=torch.long).scatter_add_(1, pack, torch.ones_like(pack))
    start = (count.cumsum(dim=1) - count).gather(1, pack.gather(1, order))  # [B, N]
    return torch.empty_like(pack).scatter_(1, order, torch.arange(n) - start)


def _slot_table(pk: np.ndarray, m: int, c: int) -> np.ndarray:  # [B, M, C] item ids, -1 = free
    b, n = pk.shape
    order = np.argsort(pk, axis=1, kind="stable")  # items grouped by pack
    sorted_pk = np.take_along_axis(pk, order, axis=1)
    count = np.zeros((b, m), dtype=np.int64)
    np.add.at(count, (np.arange(b)[:, None], pk), 1)
    start = np.cumsum(count, axis=1) - count
    pos = np.arange(n) - np.take_along_axis(start, sorted_pk, axis=1)  # [B, N] place in its pack
    table = np.full((b, m, c), -1, dtype=np.int64)
    table[np.arange(b)[:, None], sorted_pk, pos] = order
    return table


def _heaviest(items: np.ndarray, w_pad: np.ndarray, k: int):
    """Of a pack's item row ``[B, C]`` (-1 = free), the ``k`` heaviest: positions, ids, weights."""
    wv = np.take_along_axis(w_pad, items, axis=1)
    if items.shape[1] <= k:
        pos = np.broadcast_to(np.arange(items.shape[1]), items.shape)
        return pos, items, wv
    pos = np.argpartition(-wv, k - 1, axis=1)[:, :k]
    return pos, np.take_along_axis(items, pos, axis=1), np.take_along_axis(wv, pos, axis=1)


def refine(
    weight: torch.Tensor,  # [B, N]
    pack: torch.Tensor,  # [B, N] int64, a feasible assignment
    capacity: torch.Tensor,  # [M] int64
    speed: torch.Tensor | None = None,  # [M]
    max_rounds: int = 32,
    min_gain: float = 1e-9,  # relative: a change must cut the slowest pack's time by this much
    target: torch.Tensor | None = None,  # [B] a row stops once its slowest time is <= this
    group: torch.Tensor | None = None,  # [B, N] no change may put two items of a group in a pack
    base: torch.Tensor | None = None,  # [M] fixed time of each pack (its time: base + load / speed)
) -> tuple[torch.Tensor, torch.Tensor]:  # pack [B, N], items re-placed per row [B]
    """Local search on the slowest pack ``a`` of each row: the best of moving one of its items
    to a pack with room, or swapping one with an item of the fastest-finishing pack ``z``,
    applied when the slower of the two packs involved ends below ``a``'s time. Rows stop
    independently; the slowest time never rises."""
    b, n = weight.shape
    m = capacity.numel()
    w, pk = _np(weight), pack.cpu().numpy().copy()
    cap = capacity.cpu().numpy()
    inv = 1.0 / _np(speed) if speed is not None else np.ones(m)
    fixed = np.zeros(m) if base is None else _np(base)  # [M]
    changes = np.zeros(b, dtype=np.int64)
    rows = np.arange(b)
    c = min(int(cap.max()), n)
    table = _slot_table(pk, m, c)  # [B, M, C]
    w_pad = np.concatenate([w, np.full((b, 1), -1.0)], axis=1)  # item -1 -> weight -1 (free)
    load = np.zeros((b, m))
    np.add.at(load, (rows[:, None], pk), w)
    stop = None if target is None else _np(target)
    can_move = bool(((table >= 0).sum(axis=2) < cap).any())  # else every pack is full: swaps only
    g_pad = np.zeros((b, n + 1), dtype=np.int64)
    held: np.ndarray | None = None
    if group is not None:  # held[b, m, g]: items of group g in pack m; free places -> group G
        g = group.cpu().numpy()
        num_g = int(g.max()) + 1
        g_pad = np.concatenate([g, np.full((b, 1), num_g)], axis=1)
        held = np.zeros((b, m, num_g + 1), dtype=np.int64)
        np.add.at(held, (rows[:, None], pk, g), 1)
    # NOTE: a row whose best change does not help is finished (nothing of it changes later),
    # so each round only works on the rows that improved in the previous one
    act = rows  # [A] absolute rows still improving
    for _ in range(max_rounds):
        n_act = act.size
        loc = np.arange(n_act)
        t = load[act] * inv + fixed  # [A, M]
        a, z = t.argmax(axis=1), t.argmin(axis=1)  # [A]
        t_a = t[loc, a]
        w_act = w_pad[act]
        pa, ia, wa = _heaviest(table[act, a], w_act, 16)  # [A, Ca] positions, items, weights
        pz, iz, wz = _heaviest(table[act, z], w_act, 64)  # [A, Cz]
        va, vz = ia >= 0, iz >= 0
        la, lz = load[act, a][:, None, None], load[act, z][:, None, None]  # [A, 1, 1]
        inv_a, inv_z = inv[a][:, None, None], inv[z][:, None, None]
        fix_a, fix_z = fixed[a][:, None, None], fixed[z][:, None, None]
        # swap a's item i with z's item j: [A, Ca, Cz]
        d = wa[:, :, None] - wz[:, None, :]
        swap = np.maximum((la - d) * inv_a + fix_a, (lz + d) * inv_z + fix_z)
        swap[~(va[:, :, None] & vz[:, None, :]) | (d <= 0)] = _INF
        if held is not None:
            g_act = g_pad[act]
            gi, gj = np.take_along_axis(g_act, ia, axis=1), np.take_along_axis(g_act, iz, axis=1)
            clash_z = held[act[:, None], z[:, None], gi] > 0  # [A, Ca] z holds i's group
            clash_a = held[act[:, None], a[:, None], gj] > 0  # [A, Cz] a holds j's group
            swap[(clash_z[:, :, None] | clash_a[:, None, :]) & (gi[:, :, None] != gj[:, None, :])] = _INF
        k_swap = swap.reshape(n_act, -1).argmin(axis=1)
        best = swap.reshape(n_act, -1)[loc, k_swap]
        use_move = np.zeros(n_act, dtype=bool)
        if can_move:  # move a's item i to a pack q with room: [A, Ca, M]
            move = np.maximum(
                (la[:, :, 0] - wa)[:, :, None] * inv_a + fix_a,
                (load[act][:, None, :] + wa[:, :, None]) * inv + fixed,
            )
            room = ((table[act] >= 0).sum(axis=2) < cap) & (np.arange(m) != a[:, None])  # [A, M]
            move[~va[:, :, None] | ~room[:, None, :]] = _INF
            if held is not None:
                move[held[act[:, None], :, gi] > 0] = _INF  # q holds i's group
            k_move = move.reshape(n_act, -1).argmin(axis=1)
            best_move = move.reshape(n_act, -1)[loc, k_move]
            use_move = best_move < best
            best = np.minimum(best, best_move)
        ok = best < t_a * (1.0 - min_gain)  # [A]
        if stop is not None:
            ok &= t_a > stop[act]
        if not ok.any():
            break
        kz = iz.shape[1]
        sw = np.flatnonzero(ok & ~use_move)  # local
        r, ci, cj = act[sw], k_swap[sw] // kz, k_swap[sw] % kz
        i_item, j_item, pi, pj = ia[sw, ci], iz[sw, cj], pa[sw, ci], pz[sw, cj]
        ra, rz = a[sw], z[sw]
        dw = w[r, i_item] - w[r, j_item]
        table[r, ra, pi], table[r, rz, pj] = j_item, i_item
        pk[r, i_item], pk[r, j_item] = rz, ra
        if held is not None:
            gi_, gj_ = g_pad[r, i_item], g_pad[r, j_item]
            held[r, ra, gi_] -= 1
            held[r, rz, gi_] += 1
            held[r, rz, gj_] -= 1
            held[r, ra, gj_] += 1
        load[r, ra] -= dw
        load[r, rz] += dw
        changes[r] += 2
        if can_move:
            mv = np.flatnonzero(ok & use_move)  # local
            r, ci, q, ra = act[mv], k_move[mv] // m, k_move[mv] % m, a[mv]
            i_item, pi = ia[mv, ci], pa[mv, ci]
            # the moved item leaves a hole; keep each pack's items at the front of its row
            last = (table[r, ra] >= 0).sum(axis=1) - 1
            table[r, ra, pi] = table[r, ra, last]
            table[r, ra, last] = -1
            table[r, q, (table[r, q] >= 0).sum(axis=1)] = i_item
            pk[r, i_item] = q
            if held is not None:
                held[r, ra, g_pad[r, i_item]] -= 1
                held[r, q, g_pad[r, i_item]] += 1
            load[r, ra] -= w[r, i_item]
            load[r, q] += w[r, i_item]
            changes[r] += 1
        act = act[ok]
    return torch.from_numpy(pk), torch.from_numpy(changes)
