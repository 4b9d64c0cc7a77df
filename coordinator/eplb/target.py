"""EPLB's view of the expert cluster: live placement, slot capacities, and the push through
:meth:`ExpertCluster.update_placement` (prepare on all, abort on any failure, commit between
steps). The manager (coordinator/eplb/manager.py) only sees this small interface.

With expert servers shared by several coordinators (``--placement-lease``), the load a
rebalance plans with is the servers' own count of tokens per logical expert (``Stats``), which
covers every coordinator's tokens, since the last push this coordinator made (or since the
servers started): :meth:`ClusterTarget.pool_window`.

Elastic membership: servers on their way out (draining, gone from their DNS name) and servers
that are down while holding nothing count as holding no slot (capacity 0), so a plan gives them
none; a push goes on while such servers are down (they hold nothing either way). Servers that
joined and hold nothing yet are :meth:`ClusterTarget.joining` (EPLB's grow plan).

Shapes: L MoE layers, E logical experts, S servers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from coordinator.experts.cluster import ExpertCluster
from coordinator.experts.expert_conn import ExpertServerError
from expertmesh import errors
from expertmesh import placement as pl

STUCK_WAIT_S = 5.0  # a push waits this long for servers that hold experts to be usable


class ClusterTarget:
    def __init__(
        self, cluster: ExpertCluster, timeout_s: float, stopped: tuple[type[Exception], ...] = ()
    ) -> None:
        """``stopped``: what the step loop raises when the coordinator shuts down before the
        switch (the scheduler's error; serving passes it in, EPLB sits below serving)."""
        self.cluster, self.timeout_s = cluster, timeout_s
        # what a push can raise: a server failed (typed), the placement does not fit, or the
        # coordinator is shutting down before the switch
        self.errors: tuple[type[Exception], ...] = (
            ExpertServerError,
            pl.PlacementError,
            ValueError,
            *stopped,
        )

        self._base: dict[int, torch.Tensor] = {}  # server -> [L, E] counts at the last push

    def holds_role(self) -> bool:
        return self.cluster.holds_role()

    def role_holder(self) -> str:
        pool = self.cluster.pool
        return pool.seen_holder if pool is not None else ""

    def _server_counts(self, moe_layers: list[int]) -> dict[int, torch.Tensor]:  # server -> [L, E]
        out = {}
        e = self.cluster.cfg.num_experts
        for i, c in enumerate(self.cluster.conns):
            try:
                per_layer = c.expert_tokens(min(5.0, self.timeout_s))
            except ExpertServerError:
                continue  # a server down now: its tokens since the last push are not counted
            t = torch.zeros(len(moe_layers), e, dtype=torch.long)
            for row, layer in enumerate(moe_layers):
                got = per_layer.get(layer)
                if got is not None and len(got) == e:
                    t[row] = torch.tensor(got, dtype=torch.long)
            out[i] = t
        return out

    def pool_window(self, moe_layers: list[int]) -> torch.Tensor | None:  # [L, E]
        """Tokens per (layer, logical expert) every coordinator sent to the servers since this
        coordinator's last push; None when it does not share the servers."""
        if self.cluster.pool is None:
            return None
        total = torch.zeros(len(moe_layers), self.cluster.cfg.num_experts, dtype=torch.long)
        for i, now in self._server_counts(moe_layers).items():
            base = self._base.get(i)
            # NOTE: a server that restarted counts from zero again: all of its counts are new
            if base is None or bool((now < base).any()):
                base = torch.zeros_like(now)
            total += now - base
        return total

    def mark_pushed(self, moe_layers: list[int]) -> None:
        """The next window starts now (after a push)."""
        if self.cluster.pool is not None:
            self._base = self._server_counts(moe_layers)

    def live_placement(self) -> pl.Placement:
        return self.cluster.placement

    def joining(self) -> list[int]:
        """Servers that joined the pool, are up and hold no slot yet."""
        return sorted(self.cluster.joining())

    def _idle(self) -> frozenset[int]:
        """Servers no plan may give slots: leaving, or down while holding none."""
        c, live = self.cluster, self.cluster.placement
        empty = {i for i in c.down() if not any(live.server_slots(i).values())}
        return c.leaving() | empty

    def slot_capacity(self) -> torch.Tensor:  # [S]
        caps = []
        idle = self._idle()
        for i, c in enumerate(self.cluster.conns):
            if i in idle:
                caps.append(0)
                continue
            if c.info is None:
                raise ExpertServerError.of(errors.Unavailable(f"{c.spec.name} has not been described yet"))
            caps.append(c.info.slot_capacity)
        return torch.tensor(caps, dtype=torch.long)

    def default_speed(self) -> torch.Tensor:  # [S] equal until the servers' times are measured
        return torch.ones(len(self.cluster.conns), dtype=torch.float64)

    def push(self, new: pl.Placement, between_steps: Callable[[Callable[[], object]], Future]) -> list[str]:
        # NOTE: all or nothing: a server that is down now would miss the prepare and take the
        # new generation only when it returns, so the old placement stays until every server
        # that holds experts (now or in ``new``) is up
        live = self.cluster.placement

        def stuck() -> list[int]:
            return [
                i
                for i in self.cluster.down()
                if any(live.server_slots(i).values()) or any(new.server_slots(i).values())
            ]

        # NOTE: a server can be out for a moment (a refused layer ends its stream; the maintenance
        # thread reopens it within a second or so): wait that long before refusing the push
        deadline = time.monotonic() + min(STUCK_WAIT_S, self.timeout_s)
        if stuck():
            self.cluster.kick()
        while stuck():
            if time.monotonic() >= deadline:
                raise ExpertServerError.of(
                    errors.Unavailable(f"not every expert server is ready: {self.cluster.describe_state()}")
                )
            time.sleep(0.05)
        failed = self.cluster.update_placement(new, self.timeout_s, between_steps)
        return [self.cluster.conns[i].spec.name for i in failed]
