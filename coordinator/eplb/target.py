"""EPLB's view of the expert cluster: live placement, slot capacities, and the push through
:meth:`ExpertCluster.update_placement` (prepare on all, abort on any failure, commit between
steps). The manager (coordinator/eplb/manager.py) only sees this small interface."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from coordinator.experts.cluster import ExpertCluster
from coordinator.experts.expert_conn import ExpertServerError
from expertmesh import errors
from expertmesh import placement as pl


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

    def live_placement(self) -> pl.Placement:
        return self.cluster.placement

    def slot_capacity(self) -> torch.Tensor:  # [S]
        caps = []
        for c in self.cluster.conns:
            if c.info is None:
                raise ExpertServerError.of(errors.Unavailable(f"{c.spec.name} has not been described yet"))
            caps.append(c.info.slot_capacity)
        return torch.tensor(caps, dtype=torch.long)

    def default_speed(self) -> torch.Tensor:  # [S] equal until the servers' times are measured
        return torch.ones(len(self.cluster.conns), dtype=torch.float64)

    def push(self, new: pl.Placement, between_steps: Callable[[Callable[[], object]], Future]) -> list[str]:
        # NOTE: all or nothing: a server that is down now would miss the prepare and take the
        # new generation only when it returns, so the old placement stays until all are up
        if not self.cluster.ready():
            raise ExpertServerError.of(
                errors.Unavailable(f"not every expert server is ready: {self.cluster.describe_state()}")
            )
        failed = self.cluster.update_placement(new, self.timeout_s, between_steps)
        return [self.cluster.conns[i].spec.name for i in failed]
