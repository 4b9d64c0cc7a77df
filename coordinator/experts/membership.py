"""Elastic membership: the expert servers found through ``dns:///NAME:PORT`` names follow the
names as they change at run time.

Every ``dns_refresh_s`` the cluster's maintenance thread (coordinator/experts/cluster.py) asks
:meth:`DnsMembership.refresh` to re-resolve each name its servers came from, and reconciles:

- an address that left the name: its server is *leaving*, as a drained one (SIGTERM) is: steps
  route around it, its stream is closed once its answers are in, it is not reconnected, and the
  placement holder re-places its experts on the rest (coordinator/eplb/drain.py);
- a new address takes the place of a server whose address left (a replaced pod keeps its name
  and the slots the live placement gives it);
- any other new address *joins*: a new member, named after its kind and the next free number
  (cpu2, ...), holding no slot. The maintenance thread brings it up (Describe, health, the live
  generation with an empty slot table), and it gets experts at the next placement push: EPLB's
  first plan for it only adds replicas of hot experts there (coordinator/eplb/grow.py), so no
  request waits on its loading and no expert leaves another server until it holds them.

A failed or empty resolution changes nothing (a DNS outage must not drain the pool). The
resolver is passed in (``socket.getaddrinfo``, or ``--dns-hosts-file`` first), so tests run the
code a cluster runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from coordinator.experts import dns
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec

log = logging.getLogger("expertmesh.cluster")


class Cluster(Protocol):
    """What membership changes need of the cluster (coordinator/experts/cluster.py)."""

    config: ClusterConfig

    @property
    def members(self) -> Sequence[Any]: ...  # Member: conn, gone, draining
    def kick(self) -> None: ...
    def mark_down(self, i: int, error: str) -> None: ...
    def add_member(self, spec: ServerSpec) -> int: ...


class DnsMembership:
    def __init__(self, cluster: Cluster, resolver: dns.Resolver, refresh_s: float) -> None:
        self.cluster, self.resolver, self.refresh_s = cluster, resolver, refresh_s
        self._next = time.monotonic() + refresh_s

    def refresh(self, force: bool = False) -> None:
        """Re-resolves the names when due (every ``refresh_s``) and applies their answers."""
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + self.refresh_s
        groups: dict[str, list[int]] = {}
        for i, m in enumerate(self.cluster.members):
            if m.conn.spec.dns:
                groups.setdefault(m.conn.spec.dns, []).append(i)
        for name, idx in groups.items():
            parsed = dns.parse(name)
            assert parsed is not None, name
            try:
                live = set(dns.resolve(parsed, self.resolver))
            except OSError as e:
                log.warning("%s: resolution failed, servers left as they are: %s", name, e)
                continue
            if live:
                self._apply(name, idx, live)

    def _apply(self, name: str, idx: list[int], live: set[str]) -> None:
        c = self.cluster
        held = {c.members[i].conn.spec.address: i for i in idx}
        for address, i in held.items():
            if address in live and c.members[i].gone:  # its address came back
                c.members[i].gone = False
                c.kick()
        free = [i for address, i in sorted(held.items()) if address not in live]
        new = sorted(live - held.keys())
        for i, address in zip(free, new):
            m = c.members[i]
            log.info("%s: %s now at %s (was %s)", name, m.conn.spec.name, address, m.conn.spec.address)
            c.mark_down(i, f"moved to {address} ({name})")
            m.conn.retarget(address)
            m.gone = m.draining = False
        for i in free[len(new) :]:
            m = c.members[i]
            if not m.gone:
                log.info(
                    "%s: %s (%s) left the name: draining it", name, m.conn.spec.name, m.conn.spec.address
                )
                m.gone = True
                c.mark_down(i, f"its address left {name}")
                m.conn.retire_stream(f"its address left {name}", c.config.timeout_s)
        kind = c.members[idx[0]].conn.spec.kind
        for address in new[len(free) :]:
            spec = ServerSpec(self._free_name(kind), address, kind, name)
            log.info(
                "%s: %s joins as %s (no experts until the next placement push)", name, address, spec.name
            )
            c.add_member(spec)

    def _free_name(self, kind: str) -> str:
        taken = {m.conn.spec.name for m in self.cluster.members}
        n = sum(m.conn.spec.kind == kind for m in self.cluster.members)
        while f"{kind}{n}" in taken:
            n += 1
        return f"{kind}{n}"
