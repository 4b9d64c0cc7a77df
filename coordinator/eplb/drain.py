"""Servers on their way out give their experts to the rest before they go.

A server is *leaving* when its health turns NOT_SERVING (SIGTERM: it drains) or its address
leaves its DNS name (coordinator/experts/membership.py). Steps route around it at once (its
experts' replicas elsewhere take its tokens; in-flight layers it refuses are re-sent to them)
and its stream is closed, so it exits once idle. While it still holds slots in the live
placement, the placement holder re-places every expert over the servers that stay (the
degraded placement's replicate-then-pack, coordinator/eplb/degraded.py, with the leaving
servers at capacity 0) and pushes it; the servers load what they lack beside their live set,
so the commit leaves every expert with as many copies as the rest can hold, none on the
leaving server. When the rest cannot hold every expert the push is tried again every
``retry_s``; steps keep routing around the leaving server meanwhile.

A leaving server that comes back (restarted on its port, or its address returns) holds no slot
and is *joined*: the next EPLB plan gives it copies of hot experts (coordinator/eplb/grow.py).

Runs on the cluster's maintenance thread (``ExpertCluster.round_hooks``), only in the
coordinator that places experts (``holds_role``). Shapes: S servers.
"""

from __future__ import annotations

import logging
import time

import torch

from coordinator.eplb.degraded import degraded_placement
from coordinator.experts.expert_conn import ExpertServerError

log = logging.getLogger("expertmesh.degraded")


class LeavingPlacement:
    def __init__(self, cluster, timeout_s: float, retry_s: float = 5.0) -> None:  # cluster: ExpertCluster
        self.cluster, self.timeout_s, self.retry_s = cluster, timeout_s, retry_s
        self._retry_at = 0.0
        self.replaced = 0  # placements pushed for leaving servers
        cluster.round_hooks.append(self.round)

    def round(self) -> None:
        c = self.cluster
        if not c.holds_role() or time.monotonic() < self._retry_at:
            return
        live = c.placement
        holds = {i for i in range(len(live.servers)) if any(live.server_slots(i).values())}
        leaving = c.leaving() & holds
        if not leaving:
            return
        down = c.down()
        if (down - leaving) & holds:
            return  # NOTE: a server that holds experts is reconnecting: re-place once it is back
        out = frozenset(leaving | (down - holds))  # nothing goes to a server that is not up
        cap = torch.tensor(
            [
                0 if i in out or m.conn.info is None else m.conn.info.slot_capacity
                for i, m in enumerate(c.members)
            ],
            dtype=torch.long,
        )  # [S]
        names = ", ".join(c.members[i].conn.spec.name for i in sorted(leaving))
        try:
            new = degraded_placement(live, sorted(live.layers), out, cap)
            log.info(
                "%s leaving: re-placing its experts on the other servers (generation %d)",
                names,
                new.generation,
            )
            failed = c.update_placement(new, self.timeout_s)
        except (ValueError, ExpertServerError) as e:
            self._retry_at = time.monotonic() + self.retry_s
            log.warning("%s leaving: cannot re-place its experts on the others (retrying): %s", names, e)
            return
        for i in leaving:
            c.members[i].joined = True  # back one day: it gets replicas first
        self.replaced += 1
        log.info("%s hold no experts now (commit failed on servers %s)", names, failed)
