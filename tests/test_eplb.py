"""EPLB algorithm tests: hand-worked examples, and comparisons with an independent re-statement
of DeepSeek's published EPLB greedy (written here from its description, plain Python lists).

Balance = max / mean of per-GPU (or per-server) load in a layer.
"""

from __future__ import annotations

import random

import pytest
import torch

from coordinator.eplb import (
    balanced_packing,
    rebalance_experts,
    rebalance_few_moves,
    rebalance_heterogeneous,
    refine,
    replica_counts,
    server_times,
)
from expertmesh.replica import choose_load_aware

# ------------------------------------------------------------ the reference, re-stated


def ref_pack(weights: list[float], num_packs: int) -> list[int]:
    """Greedy: heaviest item first, into the lightest pack that still has fewer than
    len/num_packs items (first such pack on ties). Returns the pack of each item."""
    per_pack = len(weights) // num_packs
    load, count = [0.0] * num_packs, [0] * num_packs
    pack = [0] * len(weights)
    for item in sorted(range(len(weights)), key=lambda i: -weights[i]):
        open_packs = [p for p in range(num_packs) if count[p] < per_pack]
        target = min(open_packs, key=lambda p: load[p])
        pack[item] = target
        load[target] += weights[item]
        count[target] += 1
    return pack


def ref_replicas(weights: list[float], num_slots: int) -> list[int]:
    """One replica each, then each extra slot to the expert with the highest load per replica
    (lowest id on ties)."""
    cnt = [1] * len(weights)
    for _ in range(num_slots - len(weights)):
        best = max(range(len(weights)), key=lambda e: weights[e] / cnt[e])
        cnt[best] += 1
    return cnt


def ref_gpu_loads(weights: list[float], slots: int, groups: int, nodes: int, gpus: int) -> list[float]:
    """Hierarchical policy (global = one group, one node): groups packed onto nodes, experts
    replicated inside each node, the node's replicas packed onto its GPUs. Returns GPU loads."""
    size = len(weights) // groups
    group_load = [sum(weights[g * size : (g + 1) * size]) for g in range(groups)]
    node_of_group = ref_pack(group_load, nodes)
    gpus_per_node = gpus // nodes
    loads = [0.0] * gpus
    for node in range(nodes):
        experts = [
            x for g in range(groups) if node_of_group[g] == node for x in range(g * size, (g + 1) * size)
        ]
        cnt = ref_replicas([weights[x] for x in experts], slots // nodes)
        shares = [weights[x] / c for x, c in zip(experts, cnt) for _ in range(c)]
        for share, gpu in zip(shares, ref_pack(shares, gpus_per_node)):
            loads[node * gpus_per_node + gpu] += share
    return loads


def balance(loads: list[float]) -> float:
    return max(loads) / (sum(loads) / len(loads))


# ------------------------------------------------------------ helpers


def zipf(layers: int, experts: int, a: float = 0.8, seed: int = 0) -> torch.Tensor:  # [L, E]
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(layers)]) + 1
    return (10_000 / ranks.double() ** a).round()


def uniform(layers: int, experts: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (layers, experts), generator=g).double()


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, gpus: int) -> torch.Tensor:
    share = (weight.double() / logcnt).gather(1, phy2log)  # [L, P]
    return share.view(weight.shape[0], gpus, -1).sum(-1)  # [L, D]


def check_consistent(phy2log, log2phy, logcnt, num_experts: int) -> None:
    layers, p = phy2log.shape
    assert int(logcnt.sum()) == layers * p
    assert bool((logcnt >= 1).all())
    for layer in range(layers):
        for e in range(num_experts):
            slots = [s for s in log2phy[layer, e].tolist() if s >= 0]
            assert len(slots) == int(logcnt[layer, e])
            assert all(int(phy2log[layer, s]) == e for s in slots)


# ------------------------------------------------------------ hand-worked examples


def test_balanced_packing_hand_worked():
    # 8->A, 7->B, 6->B (B 7 < A 8), 5->A, 4->A (13 = 13: first), 3->B, 2->B (16 < 17), 1->A
    pack, rank = balanced_packing(torch.tensor([[8.0, 7, 6, 5, 4, 3, 2, 1]]), 2, refine_rounds=0)
    assert pack.tolist() == [[0, 1, 1, 0, 0, 1, 1, 0]]
    assert rank.tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]]


def test_replica_counts_hand_worked():
    w = torch.tensor([[10.0, 6, 3, 1]])
    assert replica_counts(w, 6).tolist() == [[2, 2, 1, 1]]  # grants at 10, then 6
    assert replica_counts(w, 7).tolist() == [[3, 2, 1, 1]]  # then 10/2 = 5
    assert replica_counts(w, 8).tolist() == [[4, 2, 1, 1]]  # 10/3 beats 6/2 and 3/1
    # then a tie (6/2 = 3 = 3/1) goes to the lower id, like a first-index argmax
    assert replica_counts(w, 9).tolist() == [[4, 3, 1, 1]]
    assert [ref_replicas([10, 6, 3, 1], n) for n in (8, 9)] == [[4, 2, 1, 1], [4, 3, 1, 1]]
    assert replica_counts(torch.zeros(1, 3), 5).tolist() == [[3, 1, 1]]


def test_hierarchical_hand_worked():
    # groups {0,1} (16 tokens) and {2,3} (4) each get a node; inside node 0 the spare slot
    # replicates expert 0 (10 > 6): GPU 0 holds 0, 0, 1 = 5 + 5 + 6 = 16; GPU 1 holds 2, 2, 3.
    w = torch.tensor([[10.0, 6, 3, 1]])
    phy2log, log2phy, logcnt = rebalance_experts(w, 6, 2, 2, 2)
    assert sorted(phy2log[0, :3].tolist()) == [0, 0, 1]
    assert sorted(phy2log[0, 3:].tolist()) == [2, 2, 3]
    assert logcnt.tolist() == [[2, 1, 2, 1]]
    check_consistent(phy2log, log2phy, logcnt, 4)
    assert gpu_loads(w, phy2log, logcnt, 2).tolist() == [[16.0, 4.0]]


def test_global_hand_worked():
    # replicas 0, 0, 1, 1, 2, 3 with shares 5 5 3 3 3 1; three per GPU: best split is 11 / 9
    w = torch.tensor([[10.0, 6, 3, 1]])
    phy2log, log2phy, logcnt = rebalance_experts(w, 6, 1, 1, 2)
    check_consistent(phy2log, log2phy, logcnt, 4)
    assert sorted(gpu_loads(w, phy2log, logcnt, 2)[0].tolist()) == [9.0, 11.0]


def test_one_slot_per_gpu_is_the_replication():
    w = zipf(3, 16)
    phy2log, log2phy, logcnt = rebalance_experts(w, 20, 1, 1, 20)
    check_consistent(phy2log, log2phy, logcnt, 16)
    assert logcnt.tolist() == [replica_counts(w[i : i + 1], 20)[0].tolist() for i in range(3)]


# ------------------------------------------------------------ against the reference

CONFIGS = [  # (slots, groups, nodes, gpus)
    (80, 8, 2, 8),  # hierarchical: 4 groups per node, 4 GPUs per node, 10 slots each
    (96, 8, 4, 16),  # hierarchical
    (80, 1, 1, 8),  # global
    (72, 1, 1, 24),  # global, 3 slots per GPU
    (72, 3, 2, 8),  # groups do not split over nodes: global fallback
]


@pytest.mark.parametrize("load", ["zipf", "uniform"])
@pytest.mark.parametrize("slots,groups,nodes,gpus", CONFIGS)
def test_never_worse_than_reference(load, slots, groups, nodes, gpus):
    experts = 72 if groups == 3 else 64
    weight = (zipf if load == "zipf" else uniform)(6, experts, seed=slots + gpus)
    phy2log, log2phy, logcnt = rebalance_experts(weight, slots, groups, nodes, gpus)
    check_consistent(phy2log, log2phy, logcnt, experts)
    ours = gpu_loads(weight, phy2log, logcnt, gpus)
    hier = groups % nodes == 0
    for layer in range(weight.shape[0]):
        ref = ref_gpu_loads(weight[layer].tolist(), slots, *((groups, nodes) if hier else (1, 1)), gpus)
        assert balance(ours[layer].tolist()) <= balance(ref) + 1e-9, (layer, ours[layer].tolist(), ref)


def test_local_search_helps_somewhere():
    """The local search must actually improve on the greedy for some Zipf layers (a test that
    the refinement is not a no-op)."""
    weight = zipf(8, 64, seed=3)
    better = 0
    for layer in range(8):
        ref = balance(ref_gpu_loads(weight[layer].tolist(), 80, 1, 1, 8))
        phy2log, _, logcnt = rebalance_experts(weight[layer : layer + 1], 80, 1, 1, 8)
        better += balance(gpu_loads(weight[layer : layer + 1], phy2log, logcnt, 8)[0].tolist()) < ref - 1e-9
    assert better >= 1


def test_hierarchical_keeps_groups_on_one_node():
    weight = zipf(4, 64, seed=5)
    phy2log, _, _ = rebalance_experts(weight, 80, 8, 2, 8)
    node_of_slot = torch.arange(80) // 40
    for layer in range(4):
        for g in range(8):
            nodes = {int(node_of_slot[p]) for p in range(80) if int(phy2log[layer, p]) // 8 == g}
            assert len(nodes) == 1


# ------------------------------------------------------------ heterogeneous servers


def test_heterogeneous_hand_worked():
    # the hot expert goes to the fast server: 9 tokens at speed 9, 1 token at speed 1
    phy2log, owner, _ = rebalance_heterogeneous(
        torch.tensor([[1.0, 9.0]]), torch.tensor([1, 1]), torch.tensor([9.0, 1.0]), 2
    )
    assert dict(zip(phy2log[0].tolist(), owner[0].tolist())) == {1: 0, 0: 1}


@pytest.mark.parametrize("ratio", [4.0, 10.0])
def test_heterogeneous_beats_reference_on_slowest_server(ratio):
    """2 GPU servers (speed ``ratio``) and 2 CPU servers (speed 1), equal slot counts. The
    reference balances token counts, so the CPU servers take as many tokens as the GPUs."""
    weight = zipf(6, 64, seed=11)
    slots, servers = 80, 4
    speed = torch.tensor([ratio, ratio, 1.0, 1.0])
    capacity = torch.full((servers,), slots // servers)
    phy2log, owner, _ = rebalance_heterogeneous(weight, capacity, speed, slots)
    ours = server_times(weight, phy2log, owner, speed).max(1).values
    assert bool((torch.bincount(owner[0], minlength=servers) <= capacity).all())
    for layer in range(6):
        ref_loads = torch.tensor(ref_gpu_loads(weight[layer].tolist(), slots, 1, 1, servers))
        ref_time = float((ref_loads / speed).max())
        assert float(ours[layer]) < 0.7 * ref_time, (layer, float(ours[layer]), ref_time)


def test_heterogeneous_respects_unequal_capacity():
    weight = zipf(5, 64, seed=2)
    capacity, speed = torch.tensor([8, 8, 64]), torch.tensor([10.0, 10.0, 1.0])
    phy2log, owner, logcnt = rebalance_heterogeneous(weight, capacity, speed, 72)
    for layer in range(5):
        assert bool((torch.bincount(owner[layer], minlength=3) <= capacity).all())
        assert sorted(set(phy2log[layer].tolist())) == list(range(64))
    # the GPU servers hold the hottest experts
    hot = weight.argmax(1)
    assert all(int(owner[i][phy2log[i] == hot[i]].min()) < 2 for i in range(5))


# ------------------------------------------------------------ few moves


def test_few_moves_keeps_a_balanced_placement():
    weight = zipf(6, 64, seed=1)
    capacity, speed = torch.full((8,), 10), torch.ones(8)
    phy2log, owner, _ = rebalance_heterogeneous(weight, capacity, speed, 80)
    plan = rebalance_few_moves(weight, phy2log, owner, capacity, speed, threshold=0.05)
    assert plan.moved.sum() == 0 and bool((plan.how == 0).all())
    assert torch.equal(plan.owner, owner) and torch.equal(plan.phy2log, phy2log)


@pytest.mark.parametrize("speeds", [(1.0,) * 8, (8.0, 8.0, 1, 1, 1, 1, 1, 1)])
def test_few_moves_small_load_change(speeds):
    """A +-10% change in load: at most 10% of the slots get new weights, and every layer stays
    within 5% of the from-scratch plan's slowest-server time."""
    layers, experts, slots = 12, 64, 80
    weight = zipf(layers, experts, seed=4)
    capacity, speed = torch.full((8,), 10), torch.tensor(speeds)
    phy2log, owner, _ = rebalance_heterogeneous(weight, capacity, speed, slots)
    g = torch.Generator().manual_seed(9)
    changed = (weight * (1 + 0.1 * (2 * torch.rand(weight.shape, generator=g) - 1))).round()
    plan = rebalance_few_moves(changed, phy2log, owner, capacity, speed, threshold=0.05)
    assert int(plan.moved.sum()) <= 0.10 * layers * slots, plan.moved.tolist()
    assert bool((plan.time_new <= 1.05 * plan.time_scratch + 1e-9).all())
    times = server_times(changed, plan.phy2log, plan.owner, speed).max(1).values
    assert torch.allclose(times, plan.time_new)
    for layer in range(layers):
        assert bool((torch.bincount(plan.owner[layer], minlength=8) <= capacity).all())


def test_few_moves_large_change_moves_and_rebalances():
    weight = zipf(4, 64, seed=6)
    capacity, speed = torch.full((8,), 10), torch.ones(8)
    phy2log, owner, _ = rebalance_heterogeneous(weight, capacity, speed, 80)
    shuffled = zipf(4, 64, seed=7)  # every expert's rank changes
    plan = rebalance_few_moves(shuffled, phy2log, owner, capacity, speed, threshold=0.05)
    assert bool((plan.how == 2).any())
    assert int(plan.moved.sum()) > 0
    assert bool((plan.time_new <= 1.05 * plan.time_scratch + 1e-9).all())
    assert bool((plan.time_new < plan.time_live).all())


def test_few_moves_capped_moves_the_best_layers_and_keeps_the_rest():
    """--eplb-max-moves: at most that many weights load; the layers moved are those that gain
    most per weight moved among the uncapped plan's (as planned there), every other layer is
    left exactly as it is live."""
    weight = zipf(8, 64, seed=6)
    capacity, speed = torch.full((8,), 10), torch.ones(8)
    phy2log, owner, _ = rebalance_heterogeneous(weight, capacity, speed, 80)
    shuffled = zipf(8, 64, seed=7)
    free = rebalance_few_moves(shuffled, phy2log, owner, capacity, speed, threshold=0.05)
    cap = int(free.moved.sum()) // 3
    plan = rebalance_few_moves(shuffled, phy2log, owner, capacity, speed, threshold=0.05, max_moves=cap)
    assert 0 < int(plan.moved.sum()) <= cap
    gain = (free.time_live - free.time_new) / free.moved.clamp(min=1)
    moving = [row for row in range(8) if int(plan.moved[row]) > 0]
    for row in range(8):
        if row in moving:
            assert torch.equal(plan.owner[row], free.owner[row])
            assert torch.equal(plan.phy2log[row], free.phy2log[row])
        else:
            assert torch.equal(plan.owner[row], owner[row]) and torch.equal(plan.phy2log[row], phy2log[row])
            assert float(plan.time_new[row]) == float(plan.time_live[row])
    # a layer left out gains less per weight than every layer moved, or did not fit the moves
    # left at its turn (more than are left at the end)
    left = cap - int(plan.moved.sum())
    for r in range(8):
        if r not in moving and float(gain[r]) >= min(float(gain[m]) for m in moving):
            assert int(free.moved[r]) > left, r


# ------------------------------------------------------------ load-aware replica choice


def _tables(experts_per_server: list[list[int]], num_experts: int):
    phy2log = [e for lst in experts_per_server for e in lst]
    owner = torch.tensor([s for s, lst in enumerate(experts_per_server) for _ in lst])
    rows: list[list[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(phy2log):
        rows[e].append(p)
    width = max(len(r) for r in rows)
    log2phy = torch.tensor([r + [-1] * (width - len(r)) for r in rows])
    return log2phy, torch.tensor([len(r) for r in rows]), owner, torch.tensor(phy2log)


def test_load_aware_hand_worked():
    # expert 0 on both servers; expert 1 on server 0, experts 2 and 3 on server 1
    log2phy, logcnt, owner, phy2log = _tables([[0, 1], [2, 3, 0]], 4)
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 3]])
    phys = choose_load_aware(ids, log2phy, logcnt, owner, 2)
    # base: server 0 has 2 tokens, server 1 has 4; 6 tokens of expert 0 level them at 6 + 6
    assert (owner[phys[:, 0]] == 0).sum() == 4 and (owner[phys[:, 0]] == 1).sum() == 2
    assert torch.equal(phy2log[phys], ids)
    # with server 1 twice as fast its 4 tokens take 2 time units: 2 + x = (4 + 6 - x) / 2
    phys = choose_load_aware(ids, log2phy, logcnt, owner, 2, speed=torch.tensor([1.0, 2.0]))
    assert (owner[phys[:, 0]] == 0).sum() == 2


def test_load_aware_splits_evenly_and_keeps_experts():
    log2phy, logcnt, owner, phy2log = _tables([[0, 1, 2], [0, 1, 3]], 4)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(64)])  # [64, 2]
    phys = choose_load_aware(ids, log2phy, logcnt, owner, 2)
    assert torch.equal(phy2log[phys], ids)
    for e in (0, 1):  # replicated on both servers: both replicas get tokens
        on = owner[phys[ids == e]]
        assert 0 < int((on == 0).sum()) < on.numel(), on.tolist()
    # the replicated tokens make up for the single-replica experts' difference
    n = torch.bincount(ids.flatten(), minlength=4)
    per_server = torch.bincount(owner[phys].flatten(), minlength=2)
    assert abs(int(n[2]) - int(n[3])) > 2  # the base is unequal...
    assert abs(int(per_server[0]) - int(per_server[1])) <= 2  # ...and the result is level


def test_load_aware_random_property():
    rng = random.Random(0)
    for _ in range(20):
        num_experts, servers = 8, 3
        lists = [[e for e in range(num_experts) if e % servers == s] for s in range(servers)]
        for _ in range(4):  # extra replicas
            lists[rng.randrange(servers)].append(rng.randrange(num_experts))
        log2phy, logcnt, owner, phy2log = _tables(lists, num_experts)
        ids = torch.tensor(
            [[rng.randrange(num_experts) for _ in range(1)] for _ in range(rng.randint(1, 40))]
        )
        phys = choose_load_aware(ids, log2phy, logcnt, owner, servers)
        assert torch.equal(phy2log[phys], ids)


def _pairs_on_one_server(owner: torch.Tensor, phy2log: torch.Tensor, servers: int, experts: int) -> int:
    held = torch.zeros(owner.shape[0], servers, experts, dtype=torch.long)
    held.index_put_(
        (torch.arange(owner.shape[0])[:, None], owner, phy2log), torch.ones_like(owner), accumulate=True
    )
    return int((held - 1).clamp(min=0).sum())


def test_refine_creates_no_duplicate_replicas():
    weight = zipf(6, 32, seed=8)
    capacity, speed = torch.tensor([6, 6, 40]), torch.tensor([5.0, 5.0, 1.0])
    phy2log, _, logcnt = rebalance_heterogeneous(weight, capacity, speed, 44, refine_rounds=0)
    assert int(logcnt.max()) <= 3  # at most one replica per server
    share = (weight / logcnt).gather(1, phy2log)
    owner = torch.tensor([0] * 6 + [1] * 6 + [2] * 32).expand(6, 44)  # a poor start: by slot id
    out, changes = refine(share, owner, capacity, speed, group=phy2log)
    assert int(changes.sum()) > 0
    assert _pairs_on_one_server(out, phy2log, 3, 32) <= _pairs_on_one_server(owner, phy2log, 3, 32)
    t0 = server_times(weight, phy2log, owner, speed).max(1).values
    t1 = server_times(weight, phy2log, out, speed).max(1).values
    assert bool((t1 <= t0 + 1e-9).all())


# ------------------------------------------------------------ plans on real placements


def test_plan_from_static_placement_then_skip():
    from coordinator.eplb.plan import EplbConfig, placement_tensors, plan_rebalance
    from expertmesh import placement as pl

    layers = [1, 2, 3]
    live = pl.static_split(layers, 8, [], ["cpu0", "cpu1"], 0)  # experts 0-3 | 4-7
    load = torch.tensor([[100.0, 50, 10, 5, 1, 1, 1, 1]] * 3)
    cfg = EplbConfig(redundant_slots=1, skip_threshold=0.05)
    cap, speed = torch.tensor([8, 8]), torch.ones(2)
    plan = plan_rebalance(load, live, layers, cap, speed, cfg, expert_bytes=1000)
    assert not plan.skipped and plan.placement is not None
    new = plan.placement
    assert new.generation == live.generation + 1
    for layer in layers:
        lp = new.layers[layer]
        assert len(lp.phy2log) == 10  # 8 experts + 1 redundant slot per server
        assert lp.logcnt(8)[0] == 2  # the hottest expert is replicated, once per server
        assert sorted(lp.server_experts(0) + lp.server_experts(1)) == sorted(lp.phy2log)
    # static: 166 | 4 tokens; balanced: every layer within a few tokens of 85 | 85
    assert plan.token_balance_before > 1.9 and plan.token_balance_after < 1.05
    assert plan.weights_moved > 0 and plan.bytes_moved == 1000 * plan.weights_moved
    tensors = placement_tensors(new, layers)
    assert tensors is not None and tensors[0].shape == (3, 10)
    # the same load again: nothing to gain, nothing moves
    again = plan_rebalance(load, new, layers, cap, speed, cfg, expert_bytes=1000)
    assert again.skipped and again.placement is None and again.weights_moved == 0
    # a forced plan is still produced (Admin/Rebalance on a balanced cluster)
    forced = plan_rebalance(load, new, layers, cap, speed, cfg, expert_bytes=1000, force=True)
    assert not forced.skipped and forced.placement is not None


def test_first_plan_with_replicas_adds_them_beside_the_live_slots():
    """Adding replica slots (the first plan with --eplb-redundant-slots) under --eplb-max-moves
    keeps the live slots and loads the replicas, then plans the capped moves from there: on a
    balanced live placement far fewer weights than the from-scratch plan of the new slot count,
    each layer within the move threshold of it. Without a cap the plan starts from scratch."""
    from coordinator.eplb.hetero import rebalance_heterogeneous, server_times
    from coordinator.eplb.moves import with_replica_slots
    from coordinator.eplb.plan import EplbConfig, placement_tensors, plan_rebalance, to_placement

    layers = list(range(12))
    load = zipf(12, 64, seed=3).double()
    cap, speed = torch.tensor([40, 40]), torch.tensor([1.0, 1.0])
    phy2log, owner, _ = rebalance_heterogeneous(load, cap, speed, 64)  # a balanced live placement
    live = to_placement(1, ("gpu0", "cpu0"), 64, layers, phy2log, owner)
    phy2log, owner = placement_tensors(live, layers)  # type: ignore[misc]
    grown = with_replica_slots(load, phy2log, owner, cap, speed, 68)
    assert grown is not None and grown[0].shape == (12, 68)
    assert torch.equal(grown[0][:, :64], phy2log) and torch.equal(grown[1][:, :64], owner)
    for row in range(12):  # within each server's room, no replica of an expert it holds
        extra = list(zip(grown[0][row, 64:].tolist(), grown[1][row, 64:].tolist()))
        assert bool((torch.bincount(grown[1][row], minlength=2) <= cap).all())
        assert all(e not in phy2log[row][owner[row] == o].tolist() for e, o in extra)

    # no cap: the from-scratch plan of the new slot count, as before the cap existed
    free = plan_rebalance(
        load, live, layers, cap, speed, EplbConfig(redundant_slots=2, max_move_mb=0), 1, True
    )
    assert free.layers_scratch == 12 and free.placement is not None
    # a cap the from-scratch plan fits changes nothing
    loose = EplbConfig(redundant_slots=2, skip_threshold=0.0, max_moves=free.weights_moved)
    same = plan_rebalance(load, live, layers, cap, speed, loose, 1, True)
    assert same.layers_scratch == 12 and same.weights_moved == free.weights_moved
    # a cap it does not fit: the replicas beside the live slots, then the capped moves; each layer
    # within the move threshold of the from-scratch plan, with fewer than half its moves
    half = EplbConfig(
        redundant_slots=2, skip_threshold=0.0, move_threshold=0.05, max_moves=free.weights_moved // 2
    )
    plan = plan_rebalance(load, live, layers, cap, speed, half, expert_bytes=1, force=True)
    assert plan.placement is not None and len(plan.placement.layers[0].phy2log) == 68
    s_phy, s_own, _ = rebalance_heterogeneous(load, cap, speed, 68)
    scratch = server_times(load, s_phy, s_own, speed).max(1).values
    new_phy, new_own = placement_tensors(plan.placement, layers)  # type: ignore[misc]
    assert bool((server_times(load, new_phy, new_own, speed).max(1).values <= 1.05 * scratch + 1e-9).all())
    assert plan.weights_moved < free.weights_moved / 2, (plan.weights_moved, free.weights_moved)

    capped = plan_rebalance(
        load, live, layers, cap, speed, EplbConfig(redundant_slots=2, max_moves=10), 1, True
    )
    assert capped.placement is not None and capped.weights_moved <= 12 * 4 + 10
    # the same cap in MiB: 10 weights of 100 KiB fit 1 MiB
    by_mb = plan_rebalance(
        load, live, layers, cap, speed, EplbConfig(redundant_slots=2, max_move_mb=1), 100 << 10, True
    )
    assert by_mb.placement is not None and by_mb.weights_moved == capped.weights_moved


def test_move_cap_is_the_lower_of_the_weights_and_bytes_caps():
    from coordinator.eplb.plan import EplbConfig

    qwen3_expert = 3 * 2048 * 768 * 2  # bf16 gate, up and down of Qwen3-30B-A3B
    assert EplbConfig(max_move_mb=0).move_cap(qwen3_expert) == 0  # no cap
    assert EplbConfig().move_cap(qwen3_expert) == (1024 << 20) // qwen3_expert == 113
    assert EplbConfig(max_moves=50).move_cap(qwen3_expert) == 50
    assert EplbConfig(max_moves=500).move_cap(qwen3_expert) == 113
    assert EplbConfig(max_moves=500, max_move_mb=0).move_cap(qwen3_expert) == 500
    assert EplbConfig(max_move_mb=1).move_cap(44 << 20) == 1  # one weight larger than the cap


def test_eplb_flags_reach_the_config_and_bad_values_are_refused():
    import argparse

    from coordinator.eplb.plan import EplbConfig

    p = argparse.ArgumentParser()
    EplbConfig.add_arguments(p)
    cfg = EplbConfig.from_args(p.parse_args(["--eplb-interval-steps", "8", "--eplb-max-moves", "128"]))
    assert cfg.interval_steps == 8 and cfg.max_moves == 128
    default = EplbConfig.from_args(p.parse_args([]))
    assert default.max_moves == 0 and default.max_move_mb == 1024  # capped in bytes by default
    assert EplbConfig.from_args(p.parse_args(["--eplb-max-move-mb", "0"])).max_move_mb == 0
    with pytest.raises(ValueError, match="--eplb-max-move-mb must be >= 0"):
        EplbConfig.from_args(p.parse_args(["--eplb-max-move-mb", "-1"]))
    with pytest.raises(ValueError, match="--eplb-max-moves must be >= 0"):
        EplbConfig.from_args(p.parse_args(["--eplb-max-moves", "-1"]))
    assert default.time_model == "affine"
    assert (
        EplbConfig.from_args(p.parse_args(["--eplb-time-model", "proportional"])).time_model == "proportional"
    )
    with pytest.raises(ValueError, match="--eplb-time-model must be one of"):
        EplbConfig(time_model="linear")
