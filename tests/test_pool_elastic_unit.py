"""Elastic membership without processes: the grow placement (hand-worked examples), speeds for
servers the load recorder was not sized for, and, on the real ExpertCluster with fake
connections, a leaving server's experts re-placed on the rest, then its return as a joined
server that EPLB's next plan gives copies of hot experts (nothing moved elsewhere)."""

from __future__ import annotations

import pytest
import torch

from coordinator.eplb.drain import LeavingPlacement
from coordinator.eplb.grow import grow_placement, with_servers
from coordinator.eplb.manager import EplbManager, fit_speed
from coordinator.eplb.plan import EplbConfig
from coordinator.eplb.target import ClusterTarget
from coordinator.experts.cluster import ServerState
from coordinator.experts.load_recorder import LoadRecorder
from expertmesh import placement as pl
from tests.test_cluster_state import FakeServer, make, wait_for
from tests.test_eplb_manager import now


def test_grow_adds_copies_of_the_most_loaded_experts_per_replica_and_moves_nothing():
    live = pl.from_server_lists(
        3, ("a", "b", "c"), 4, {0: {"a": [0, 1], "b": [2, 3]}, 1: {"a": [0, 1, 2], "b": [0, 3]}}
    )
    # layer 0: per-copy load [10, 1, 1, 4]: 0 first (then 5 per copy), then 3 (4 > 1);
    # its share is ceil(4 slots / 2 servers holding) = 2 copies
    # layer 1: expert 0 has two copies: per copy [6/2, 2, 1, 1.5] -> 0 (3), then 1 (2), then 3
    # (1.5 > 1): a share of ceil(5 / 2) = 3 copies
    weight = torch.tensor([[10.0, 1, 1, 4], [6.0, 2, 1, 1.5]])
    new = grow_placement(live, [0, 1], [2], torch.tensor([4, 4, 4]), weight)
    assert new.generation == 4 and new.servers == live.servers
    assert new.to_json()["layers"] == {
        "0": {"a": [0, 1], "b": [2, 3], "c": [0, 3]},
        "1": {"a": [0, 1, 2], "b": [0, 3], "c": [0, 1, 3]},
    }
    # its capacity bounds the copies; no load measured: the experts with fewest copies first
    new = grow_placement(live, [0, 1], [2], torch.tensor([4, 4, 1]), torch.zeros(2, 4))
    assert new.to_json()["layers"]["0"]["c"] == [0] and new.to_json()["layers"]["1"]["c"] == [1]
    with pytest.raises(ValueError, match="not joining"):
        grow_placement(live, [0, 1], [1], torch.tensor([4, 4, 4]))


def test_with_servers_extends_an_older_placement_and_refuses_another_list():
    p = pl.from_server_lists(2, ("a", "b"), 2, {0: {"a": [0], "b": [1]}})
    q = with_servers(p, ("a", "b", "c"))
    assert q.servers == ("a", "b", "c") and q.server_slots(2) == {0: []} and q.layers == p.layers
    with pytest.raises(ValueError, match="do not extend"):
        with_servers(p, ("b", "a"))


def test_fit_speed_gives_servers_joined_since_or_never_measured_the_mean_measured_speed():
    default = torch.ones(3, dtype=torch.float64)
    assert torch.equal(fit_speed(None, default), default)
    assert fit_speed(torch.tensor([2.0, 4.0], dtype=torch.float64), default).tolist() == [2.0, 4.0, 3.0]
    assert fit_speed(torch.tensor([2.0, 4.0, 5.0], dtype=torch.float64), default).tolist() == [2.0, 4.0, 5.0]
    # a server never measured (NaN) counts as the mean of the measured ones, too
    nan = float("nan")
    assert fit_speed(torch.tensor([2.0, nan, 4.0], dtype=torch.float64), default).tolist() == [2.0, 3.0, 4.0]
    assert torch.equal(fit_speed(torch.tensor([nan, nan], dtype=torch.float64), default), default)


def drain(c, server, i: int) -> None:
    """SIGTERM of member ``i``: its health says NOT_SERVING (the fakes have no health: marked
    as the maintenance thread marks it), it is routed around and exits."""
    server.up = False
    c.members[i].draining = True
    c.mark_down(i, "draining (health NOT_SERVING)")


def test_a_leaving_server_is_re_placed_then_returns_and_gets_copies_first():
    gpu, cpu = FakeServer(capacity=4), FakeServer(capacity=4)
    c, conns = make(gpu, cpu)  # gpu0 holds experts 0, 1; cpu0 holds 2, 3
    hook = LeavingPlacement(c, 2.0, retry_s=0.1)
    try:
        c.connect(5)
        gen = c.placement.generation
        drain(c, cpu, 1)
        wait_for(lambda: hook.replaced == 1)
        assert c.placement.generation == gen + 1 and gpu.table == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
        assert c.placement.server_slots(1) == {0: [], 1: []} and c.covered()
        assert ("prepare", gen + 1) not in cpu.calls

        # restarted: it comes back holding nothing, and EPLB's next plan only adds copies there
        cpu.up = True
        wait_for(c.ready)
        assert cpu.table == {0: [], 1: []} and c.joining() == frozenset({1})
        assert not c.members[1].draining and c.members[1].state is ServerState.READY
        rec = LoadRecorder([0, 1], 4, window_steps=4, num_servers=2)
        for _ in range(4):
            for layer in (0, 1):  # expert 0 takes most tokens, then 1
                rec.record(layer, torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3]]))
        m = EplbManager(EplbConfig(), rec, ClusterTarget(c, 2.0), expert_bytes=10, between_steps=now)
        out = m.rebalance()
        assert out.kind == "rebalanced" and "cpu0 joined" in out.plan.reason, out.line()
        assert gpu.table == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}  # nothing moved off gpu0
        assert cpu.table == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}  # its share: gpu0's 4 slots
        assert c.joining() == frozenset() and hook.replaced == 1
        # a second plan is a whole-pool plan again (not a grow)
        assert "joined" not in m.rebalance(dry_run=True).plan.reason
    finally:
        c.close()


def test_the_rest_too_small_keeps_routing_around_and_retries(caplog):
    gpu, cpu = FakeServer(capacity=2), FakeServer(capacity=4)
    c, _ = make(gpu, cpu)
    hook = LeavingPlacement(c, 2.0, retry_s=0.1)
    try:
        c.connect(5)
        gen = c.placement.generation
        drain(c, cpu, 1)
        wait_for(lambda: caplog.text.count("cannot re-place its experts") >= 2)  # retried
        assert "fewer than the 4 experts" in caplog.text  # gpu0 holds 2 slots per layer at most
        assert c.placement.generation == gen and hook.replaced == 0 and ("prepare", gen + 1) not in gpu.calls
        assert c.down() == frozenset({1}) and c.serving_some()
        # a push of EPLB is refused too: cpu0 holds experts and is down
        target = ClusterTarget(c, 2.0)
        assert target.slot_capacity().tolist() == [2, 0]
    finally:
        c.close()


def test_an_address_that_leaves_the_name_is_re_placed_like_a_drained_server():
    from tests.test_dns_membership import Table
    from tests.test_dns_membership import make as make_dns

    table = Table(["10.0.0.2", "10.0.0.3"])
    c, servers, _ = make_dns(table, "10.0.0.2", "10.0.0.3")
    hook = LeavingPlacement(c, 2.0, retry_s=0.1)
    try:
        c.connect(5)
        gen = c.placement.generation
        stays = servers["10.0.0.2:7000"]
        assert stays.table == {0: [0, 1], 1: [0, 1]}  # cpu1 holds 2 and 3, nowhere else
        table.ips = ["10.0.0.2"]  # the pod is removed (scaled down): its server still runs
        wait_for(lambda: hook.replaced == 1)
        assert c.members[1].gone and c.leaving() == frozenset({1})
        assert stays.table == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]} and c.placement.generation == gen + 1
        assert c.placement.server_slots(1) == {0: [], 1: []} and c.covered()
        assert servers["10.0.0.3:7000"].generation == gen  # never pushed to: it left
    finally:
        c.close()


def test_a_follower_that_finds_a_joined_server_late_reads_its_slots_from_the_servers():
    from coordinator.experts.cluster import ExpertCluster
    from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
    from expertmesh.transport import negotiate
    from tests.test_cluster_state import MODEL
    from tests.test_pool_unit import LeasedConn, LeasedServer

    specs = (ServerSpec("gpu0", "fake:1", "gpu"), ServerSpec("cpu0", "fake:2", "cpu"))
    third = ServerSpec("cpu1", "fake:3", "cpu")
    by_name = {"gpu0": LeasedServer(), "cpu0": LeasedServer(), "cpu1": LeasedServer()}
    config = ClusterConfig(specs, num_gpu_experts=2, timeout_s=2.0, placement_lease_s=1.5)

    def coordinator() -> ExpertCluster:
        return ExpertCluster(
            MODEL,  # type: ignore[arg-type]
            config,
            "cpu",
            connect=lambda spec: LeasedConn(spec, by_name[spec.name]),  # type: ignore[arg-type,return-value]
            local_side=negotiate.Side("host"),
        )

    a, b = coordinator(), coordinator()
    try:
        a.connect(5)
        b.connect(5)
        assert a.holds_role() and not b.holds_role()
        a.add_member(third)  # the holder resolves the new address first
        wait_for(a.ready)
        gen = a.placement.generation
        assert by_name["cpu1"].generation == gen and by_name["cpu1"].table == {0: [], 1: []}
        # EPLB's grow plan gives it copies of experts 0 and 2 (nothing moves) before b knows it
        lists = {layer: {"gpu0": [0, 1], "cpu0": [2, 3], "cpu1": [0, 2]} for layer in (0, 1)}
        grown = pl.from_server_lists(gen + 1, a.placement.servers, 4, lists)
        assert a.update_placement(grown, 2.0) == []
        wait_for(lambda: b.placement.generation == gen + 1, timeout=10)
        assert b.placement.servers == ("gpu0", "cpu0")  # adopted without the server it lacks
        b.add_member(third)
        wait_for(lambda: b.ready() and b.placement.servers == grown.servers, timeout=10)
        wait_for(lambda: b.placement.layers == grown.layers, timeout=10)
        assert b.placement.generation == gen + 1 and b.joining() == frozenset()
    finally:
        a.close()
        b.close()


def test_a_joined_server_gets_the_link_offer_of_the_others():
    """A CUDA coordinator's dispatcher sets a link shape on each connection it starts with; a
    server that joins at run time gets the same (else it would never link)."""
    from tests.test_cluster_state import FakeConn, FakeServer, make

    c, conns = make(FakeServer(), FakeServer())
    try:
        for conn in conns:
            conn.link_shape = (64, 8, 2)  # type: ignore[attr-defined]
        joined: list[FakeConn] = []

        def make_conn(spec):
            conn = FakeConn(spec, FakeServer())
            conn.link_shape = None  # type: ignore[attr-defined]  # a new ServerConnection's
            joined.append(conn)
            return conn

        c._make = make_conn
        from coordinator.experts.cluster_config import ServerSpec

        c.add_member(ServerSpec("cpu1", "fake:3", "cpu"))
        assert joined and joined[0].link_shape == (64, 8, 2)
    finally:
        c.close()
