"""Expert servers named by a DNS name (``--cpu-server dns:///NAME:PORT``): parsing, resolution to
one server per address at start, and the cluster following the name as it changes (fake
connections and a table resolver; the resolver is the only thing swapped: in a cluster it is
getaddrinfo). A real-process run on loopback addresses is in test_dns_membership_e2e.py."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from coordinator.experts import dns
from coordinator.experts.cluster import ExpertCluster, ServerState
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from expertmesh import placement as pl
from expertmesh.transport import negotiate
from tests.test_cluster_state import MODEL, FakeConn, FakeServer, wait_for

NAME = "dns:///experts.example:7000"


class Table:
    """A resolver whose answers the test sets (host -> IPs; raises like getaddrinfo when told)."""

    def __init__(self, ips: list[str]) -> None:
        self.ips, self.fail = ips, False
        self.asked = 0

    def __call__(self, host: str, port: int) -> list[str]:
        assert host == "experts.example", host
        self.asked += 1
        if self.fail:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [dns.join(ip, port) for ip in self.ips]


def test_parse_and_join():
    assert dns.parse("10.0.0.1:5") is None and dns.parse("host:5") is None
    assert dns.parse(NAME) == dns.DnsName("experts.example", 7000) and str(dns.parse(NAME)) == NAME
    for bad in (
        "dns:///experts",
        "dns:///experts:0",
        "dns:///:7000",
        "dns://8.8.8.8/experts:7000",
        "dns:///[::1]:7",
    ):
        with pytest.raises(ValueError, match="dns:///NAME:PORT|DNS name"):
            dns.parse(bad)
    with pytest.raises(ValueError):  # at the command line already
        ServerSpec("cpu0", "dns:///experts", "cpu")
    assert dns.join("10.0.0.1", 7) == "10.0.0.1:7" and dns.join("fd00::1", 7) == "[fd00::1]:7"


def test_getaddrinfo_is_the_default_resolver():
    assert dns.resolve(dns.DnsName("localhost", 7000)) in (
        ("127.0.0.1:7000",),
        ("127.0.0.1:7000", "[::1]:7000"),
        ("[::1]:7000",),
    )


def test_resolved_config_has_one_server_per_address_named_by_position():
    table = Table(["10.0.0.3", "10.0.0.2", "10.0.0.3"])  # rotation and repeats do not matter
    config = ClusterConfig((ServerSpec("gpu0", "g:1", "gpu"), ServerSpec("cpu0", NAME, "cpu")))
    got = config.resolved(table).servers
    assert got == (
        ServerSpec("gpu0", "g:1", "gpu"),
        ServerSpec("cpu0", "10.0.0.2:7000", "cpu", NAME),
        ServerSpec("cpu1", "10.0.0.3:7000", "cpu", NAME),
    )
    listed = ClusterConfig((ServerSpec("cpu0", "c:1", "cpu"),))
    assert listed.resolved(table) is listed
    table.ips = []
    with pytest.raises(ValueError, match="resolves to no address"):
        config.resolved(table, wait_s=0)


def make(table: Table, *ips: str) -> tuple[ExpertCluster, dict[str, FakeServer], list[FakeConn]]:
    """A cluster over ``NAME`` with one fake server per IP (a server per address, as pods)."""
    servers = {dns.join(ip, 7000): FakeServer() for ip in ips}
    config = ClusterConfig((ServerSpec("cpu0", NAME, "cpu"),), timeout_s=2.0, dns_refresh_s=0.05)
    config = config.resolved(table)
    conns: list[FakeConn] = []

    class Conn(FakeConn):
        """The connection follows its address to whichever fake server lives there."""

        def retarget(self, address: str) -> None:
            self.reset("retargeted")
            self.spec = dataclasses.replace(self.spec, address=address)
            self.server, self.info = servers[address], None

        def retire_stream(self, reason: str, timeout: float) -> None:
            self.stream = False

    def connect(spec: ServerSpec) -> FakeConn:
        conns.append(Conn(spec, servers[spec.address]))
        return conns[-1]

    cluster = ExpertCluster(
        MODEL,  # type: ignore[arg-type]
        config,
        "cpu",
        connect=connect,  # type: ignore[arg-type]
        local_side=negotiate.Side("host"),
        resolver=table,
    )
    return cluster, servers, conns


def addresses(c: ExpertCluster) -> list[str]:
    return [m.conn.spec.address for m in c.members]


def test_a_replaced_address_takes_the_servers_place_with_the_live_placement():
    table = Table(["10.0.0.2", "10.0.0.3"])
    c, servers, _ = make(table, "10.0.0.2", "10.0.0.3", "10.0.0.4")
    try:
        c.connect(5)
        live = c.placement.generation
        assert addresses(c) == ["10.0.0.2:7000", "10.0.0.3:7000"] and c.ready()
        old = servers["10.0.0.3:7000"]
        # the pod behind .3 is replaced by one at .4: cpu1 follows it, with cpu1's experts
        old.up = False
        table.ips = ["10.0.0.2", "10.0.0.4"]
        new = servers["10.0.0.4:7000"]
        wait_for(lambda: c.ready() and addresses(c)[1] == "10.0.0.4:7000")
        assert [m.conn.spec.name for m in c.members] == ["cpu0", "cpu1"]
        assert new.calls == [("prepare", live), ("commit", live)] and new.table == old.table
        assert servers["10.0.0.2:7000"].calls == [("prepare", live), ("commit", live)]  # left alone
    finally:
        c.close()


def test_a_vanished_address_is_drained_and_not_reconnected_until_it_returns():
    table = Table(["10.0.0.2", "10.0.0.3"])
    c, servers, conns = make(table, "10.0.0.2", "10.0.0.3")
    try:
        c.connect(5)
        gone = servers["10.0.0.3:7000"]
        table.ips = ["10.0.0.2"]
        wait_for(lambda: c.members[1].gone)
        m = c.members[1]
        assert m.state is ServerState.UNAVAILABLE and "left dns:///experts.example:7000" in m.last_error
        assert not conns[1].stream and c.down() == frozenset({1})
        # its experts had no other replica: uncovered until it returns (or --degraded-replace-after
        # re-places them on cpu0); a step routes around it as around a drained server
        assert not c.covered() and c.serving_some()
        calls = list(gone.calls)
        asked = table.asked
        wait_for(lambda: table.asked >= asked + 3)  # several refreshes later: still not reconnected
        assert gone.calls == calls and m.gone
        table.ips = ["10.0.0.2", "10.0.0.3"]  # back (e.g. the same pod's readiness returned)
        wait_for(c.ready)
        assert not m.gone and conns[1].stream
    finally:
        c.close()


def test_a_failed_resolution_changes_nothing():
    table = Table(["10.0.0.2"])
    c, _, _ = make(table, "10.0.0.2")
    try:
        c.connect(5)
        table.fail = True
        asked = table.asked
        wait_for(lambda: table.asked >= asked + 2)
        assert c.ready() and addresses(c) == ["10.0.0.2:7000"]
    finally:
        c.close()


def test_a_new_address_joins_holding_no_slot_at_the_live_generation():
    table = Table(["10.0.0.2"])
    c, servers, conns = make(table, "10.0.0.2", "10.0.0.3")
    try:
        c.connect(5)
        live = c.placement
        table.ips = ["10.0.0.2", "10.0.0.3"]
        wait_for(lambda: len(c.members) == 2 and c.ready())
        assert [m.conn.spec.name for m in c.members] == ["cpu0", "cpu1"]
        assert addresses(c) == ["10.0.0.2:7000", "10.0.0.3:7000"] and conns[1].stream
        # the same generation over one more server, which holds nothing: no expert moved
        p = c.placement
        assert p.generation == live.generation and p.servers == ("cpu0", "cpu1") and p.layers == live.layers
        new = servers["10.0.0.3:7000"]
        assert new.calls == [("prepare", live.generation), ("commit", live.generation)]
        assert new.table == {0: [], 1: []}
        assert c.joining() == frozenset({1}) and c.leaving() == frozenset()
        assert [i["name"] for i in c.server_infos()] == ["cpu0", "cpu1"]
        # the next push may give it experts (the server list is the grown one)
        every = {0: {"cpu0": [0, 1, 2, 3], "cpu1": [0, 1]}, 1: {"cpu0": [0, 1, 2, 3], "cpu1": [2, 3]}}
        c.update_placement(pl.from_server_lists(p.generation + 1, p.servers, 4, every), 2.0)
        assert new.table == {0: [0, 1], 1: [2, 3]} and c.joining() == frozenset()
    finally:
        c.close()
