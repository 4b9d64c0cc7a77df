"""Placement as pure data: hand-worked tables for static splits, replicas, replica choice, the
per-server split and the prefill "full server" tables."""

from __future__ import annotations

import json

import pytest
import torch

from expertmesh import placement as pl


def test_static_split_hand_worked():
    p = pl.static_split([0, 2], 8, ["gpu0"], ["cpu0", "cpu1"], 3)
    assert p.generation == 1 and p.servers == ("gpu0", "cpu0", "cpu1") and set(p.layers) == {0, 2}
    lp = p.layers[2]
    # gpu0 takes 0..2; the five CPU experts 3..7 split in contiguous runs: 5 // 2 = 2 first
    assert lp.phy2log == (0, 1, 2, 3, 4, 5, 6, 7)
    assert lp.owner == (0, 0, 0, 1, 1, 2, 2, 2)
    assert lp.local_slot == (0, 1, 2, 0, 1, 0, 1, 2)
    assert p.server_slots(1) == {0: [3, 4], 2: [3, 4]}
    assert p.server_slots(2)[0] == [5, 6, 7]


@pytest.mark.parametrize(
    "args, words",
    [
        ((8, ["gpu0"], ["cpu0"], 9), "outside [0, 8]"),
        ((8, [], ["cpu0"], 2), "needs a GPU expert server"),
        ((8, ["gpu0"], [], 6), "need a CPU expert server"),
    ],
)
def test_static_split_refuses_impossible_counts(args, words):
    with pytest.raises(pl.PlacementError, match=words.replace("[", r"\[").replace("]", r"\]")):
        pl.static_split([0], *args)


def replicated() -> pl.Placement:
    # expert 0 and 1 on both servers; cpu0 lists them in its own slot order
    return pl.from_server_lists(4, ("gpu0", "cpu0"), 4, {0: {"gpu0": [0, 1], "cpu0": [0, 2, 3, 1]}})


def test_replicas_hand_worked():
    p = replicated()
    lp = p.layers[0]
    assert lp.phy2log == (0, 1, 0, 2, 3, 1)
    assert lp.owner == (0, 0, 1, 1, 1, 1)
    assert lp.local_slot == (0, 1, 0, 1, 2, 3)
    assert lp.logcnt(4) == [2, 2, 1, 1]
    assert lp.log2phy(4) == [[0, 2], [1, 5], [3, -1], [4, -1]]
    assert lp.server_experts(1) == [0, 2, 3, 1]
    t = p.tables[0]
    assert t.log2phy.tolist() == [[0, 2], [1, 5], [3, -1], [4, -1]] and t.logcnt.tolist() == [2, 2, 1, 1]


def test_choose_replicas_static_and_round_robin():
    t = replicated().tables[0]
    ids = torch.tensor([[0, 3], [1, 2]])
    assert pl.choose_replicas(ids, t, "static").tolist() == [[0, 4], [1, 3]]
    # pairs numbered 0..3 from offset 0: replica = number % replicas -> all first replicas
    assert pl.choose_replicas(ids, t, "round_robin", 0).tolist() == [[0, 4], [1, 3]]
    # from offset 1: pairs 1, 2, 3, 4 -> experts 0 and 1 take their second replica (2 and 5)
    assert pl.choose_replicas(ids, t, "round_robin", 1).tolist() == [[2, 4], [5, 3]]
    with pytest.raises(pl.PlacementError, match="unknown replica policy"):
        pl.choose_replicas(ids, t, "load_balanced")


def test_split_by_server_masks_other_servers_slots():
    t = replicated().tables[0]
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    # physical 0 (gpu0 slot 0), 4 (cpu0 slot 2), 1 (gpu0 slot 1), 3 (cpu0 slot 1)
    b0, b1 = pl.split_by_server(torch.tensor([[0, 4], [1, 3]]), w, t, 2)
    assert (b0.server, b0.rows.tolist(), b0.slot_ids.tolist()) == (0, [0, 1], [[0, -1], [1, -1]])
    assert (b1.server, b1.rows.tolist(), b1.slot_ids.tolist()) == (1, [0, 1], [[-1, 2], [-1, 1]])
    assert b0.slot_ids.dtype == torch.int32 and b0.weights.dtype == torch.float32
    assert torch.equal(b1.weights, w)
    # a row wholly on one server is sent only there (compacted)
    only = pl.split_by_server(torch.tensor([[0, 1], [3, 4]]), w, t, 2)
    assert [(b.server, b.rows.tolist(), b.slot_ids.tolist()) for b in only] == [
        (0, [0], [[0, 1]]),
        (1, [1], [[1, 2]]),
    ]
    assert torch.equal(only[1].weights, w[1:])


def test_full_server_tables_append_missing_experts():
    p = pl.from_server_lists(2, ("gpu0", "cpu0"), 4, {0: {"gpu0": [2, 0], "cpu0": [1, 3]}})
    st = pl.server_tables(p)
    assert st.full_server is None and st.slots == ({0: [2, 0]}, {0: [1, 3]}) and st.generation == 2
    st = pl.server_tables(p, full_server=0)
    assert st.slots[0] == {0: [2, 0, 1, 3]} and st.slots[1] == {0: [1, 3]}
    assert st.full_slots is not None and st.full_slots[0].tolist() == [1, 2, 0, 3]
    assert st.slots_needed(0) == 4 and st.slots_needed(1) == 2
    b = pl.all_on_server(st, 0, torch.tensor([[2, 1], [3, 0]]), torch.tensor([[0.5, 0.5], [1.0, 0.0]]))
    assert (b.server, b.rows.tolist(), b.slot_ids.tolist()) == (0, [0, 1], [[0, 2], [3, 1]])
    # an expert replicated on the full server: its first slot is used
    p2 = pl.from_server_lists(1, ("gpu0", "cpu0"), 3, {0: {"gpu0": [2, 2], "cpu0": [0, 1]}})
    st2 = pl.server_tables(p2, full_server=0)
    assert st2.slots[0] == {0: [2, 2, 0, 1]} and st2.full_slots is not None
    assert st2.full_slots[0].tolist() == [2, 3, 0]


def test_invalid_placements_are_refused():
    with pytest.raises(pl.PlacementError, match=r"experts \[3\] have no slot"):
        pl.from_server_lists(1, ("gpu0",), 4, {0: {"gpu0": [0, 1, 2]}})
    with pytest.raises(pl.PlacementError, match="unknown servers"):
        pl.from_server_lists(1, ("gpu0",), 2, {0: {"gpu1": [0, 1]}})
    with pytest.raises(pl.PlacementError, match="outside"):
        pl.from_server_lists(1, ("gpu0",), 2, {0: {"gpu0": [0, 1, 2]}})
    bad = pl.Placement(1, ("gpu0",), 2, {0: pl.LayerPlacement((0, 1), (0, 0), (0, 2))})
    with pytest.raises(pl.PlacementError, match="not 0..n-1"):
        bad.validate()
    with pytest.raises(pl.PlacementError, match="ragged"):
        pl.LayerPlacement((0, 1), (0,), (0, 1))


def test_placement_file_default_override_and_round_trip(tmp_path):
    spec = {
        "servers": ["gpu0", "cpu0"],
        "layers": {
            "*": {"gpu0": [0, 1, 2, 3], "cpu0": [0, 4, 5, 6, 7]},
            "5": {"gpu0": [0, 1], "cpu0": [2, 3, 4, 5, 6, 7]},
        },
    }
    f = tmp_path / "p.json"
    f.write_text(json.dumps(spec))
    p = pl.load_file(f, [1, 5], 8, ("gpu0", "cpu0"))
    assert p.server_slots(0) == {1: [0, 1, 2, 3], 5: [0, 1]}
    assert p.layers[1].logcnt(8) == [2, 1, 1, 1, 1, 1, 1, 1]
    f.write_text(json.dumps(p.to_json()))
    assert pl.load_file(f, [1, 5], 8, ("gpu0", "cpu0")).layers == p.layers
    with pytest.raises(pl.PlacementError, match="not MoE layers"):
        pl.load_file(f, [1], 8, ("gpu0", "cpu0"))
    with pytest.raises(pl.PlacementError, match="differ from the configured"):
        pl.load_file(f, [1, 5], 8, ("gpu0", "cpu1"))


def test_live_tables_route_around_down_servers():
    t = replicated().tables[0]  # experts 0, 1 on both servers; 2, 3 only on cpu0
    live = pl.live_tables(t, frozenset({1}))  # cpu0 down
    assert live.log2phy.tolist() == [[0], [1], [-1], [-1]] and live.logcnt.tolist() == [1, 1, 0, 0]
    live = pl.live_tables(t, frozenset({0}))  # gpu0 down: the CPU replicas move first
    assert live.log2phy.tolist() == [[2], [5], [3], [4]] and live.logcnt.tolist() == [1, 1, 1, 1]
    ids = torch.tensor([[0, 1], [1, 3]])
    for policy in ("static", "round_robin"):
        assert pl.choose_replicas(ids, live, policy, 3).tolist() == [[2, 5], [5, 4]]
    assert pl.live_tables(t, frozenset()) is t
    assert pl.uncovered({0: t}, frozenset({0})) == {}
    assert pl.uncovered({0: t, 3: t}, frozenset({1})) == {0: [2, 3], 3: [2, 3]}


def test_split_by_server_only_the_given_pairs():
    t = replicated().tables[0]
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    pairs = torch.tensor([[False, True], [False, False]])  # re-send only (token 0, k 1)
    (b,) = pl.split_by_server(torch.tensor([[0, 4], [1, 3]]), w, t, 2, pairs)
    assert (b.server, b.rows.tolist(), b.slot_ids.tolist()) == (1, [0], [[-1, 2]])
