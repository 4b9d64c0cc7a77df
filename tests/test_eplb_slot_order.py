"""The slot order of a rebalanced placement: an expert a server keeps stays in its slot, so the
expert server's commit (which pauses serving) rewrites only the slots whose expert changes.
Checked by hand and against the worker's own move planner (expertmesh/worker/moves.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from coordinator.eplb.plan import EplbConfig, placement_tensors, plan_rebalance, stable_slots, to_placement
from expertmesh import placement as pl
from expertmesh.worker.moves import plan_layer


def test_stable_slots_hand_worked():
    # 7 leaves slot 2: 3 takes it; the others keep theirs (ascending order would move all four)
    assert stable_slots([4, 1, 7, 2], [1, 2, 3, 4]) == [4, 1, 3, 2]
    assert stable_slots([0, 1, 2, 3], [3, 1]) == [3, 1]  # fewer slots: 1 keeps slot 1
    assert stable_slots([5, 6], [7, 6, 5]) == [5, 6, 7]  # more slots: the new one at the end
    assert stable_slots([2, 2, 3], [4, 2, 2]) == [2, 2, 4]  # two replicas of 2 on one server
    assert stable_slots([], [3, 1]) == [1, 3]


@pytest.mark.parametrize("seed", range(20))
def test_only_changed_slots_are_rewritten(seed):
    """Same slot count: the worker's plan moves no kept expert and reads exactly the new ones."""
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    live = rng.sample(range(32), n)
    kept = rng.sample(live, rng.randint(0, n))
    new = kept + rng.sample(sorted(set(range(32)) - set(live)), n - len(kept))
    rng.shuffle(new)
    out = stable_slots(live, new)
    assert Counter(out) == Counter(new)
    plan = plan_layer(tuple(live), tuple(out))
    assert not plan.resize and plan.moves == ()
    assert sorted(e for _, e in plan.reads) == sorted(set(new) - set(live))
    ascending = plan_layer(tuple(live), tuple(sorted(new)))
    assert len(ascending.moves) + len(ascending.reads) >= len(plan.reads)


def test_rebalance_keeps_the_slots_of_kept_experts():
    """A plan from a live placement: the same experts on each server as in ascending order, and
    on every (layer, server) whose slot count stays, only the slots of experts it did not hold
    (or holds once more) rewritten."""
    g = torch.Generator().manual_seed(0)
    layers, e = [0, 1, 2, 3], 16
    live = pl.static_split(layers, e, ["gpu0"], ["cpu0"], 8)
    cap, speed = torch.tensor([12, 12]), torch.tensor([3.0, 1.0], dtype=torch.float64)
    cfg = EplbConfig(redundant_slots=2, skip_threshold=0.0, move_threshold=0.0)
    checked = 0
    for _ in range(4):
        load = (torch.rand(len(layers), e, generator=g) ** 3 * 1000).round().double()
        plan = plan_rebalance(load, live, layers, cap, speed, cfg, expert_bytes=1)
        assert plan.placement is not None
        new = plan.placement
        tensors = placement_tensors(new, layers)
        assert tensors is not None
        ascending = to_placement(new.generation, new.servers, e, layers, *tensors)
        for s in range(len(new.servers)):
            old, got, want = live.server_slots(s), new.server_slots(s), ascending.server_slots(s)
            for layer in layers:
                assert Counter(got[layer]) == Counter(want[layer])
                if len(got[layer]) == len(old[layer]):
                    # a move copies an expert the server holds into a second slot (a replica);
                    # its source slot keeps it
                    p = plan_layer(tuple(old[layer]), tuple(got[layer]))
                    assert all(got[layer][src] == old[layer][src] for _, src in p.moves), (old, got)
                    kept = sum((Counter(old[layer]) & Counter(got[layer])).values())
                    assert len(p.moves) + len(p.reads) == len(got[layer]) - kept
                    checked += 1
        live = new
    assert checked > 0
