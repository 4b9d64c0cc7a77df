"""Degraded placement (opt-in ``--degraded-replace-after SECONDS``): when an expert
server stays down that long and some experts have no live replica, every expert is placed again
over the servers that are left (EPLB: DeepSeek's replicate-then-pack as extended in
coordinator/eplb/hetero.py) and pushed with the cluster's two-phase ``update_placement``; the
servers load the experts they did not hold from the checkpoint, and full coverage is back.

When every server of the placement that was live before is back, that placement is restored
(as a new generation). Why restore rather than keep the degraded one: the degraded placement
packs all experts onto fewer servers (the returning one would hold nothing and idle), and the
one before it is what the operator (placement file, static split) or the EPLB manager chose for
the full cluster; the periodic EPLB, when on, still rebalances from there.

:func:`degraded_placement` is pure (no gRPC, no threads); :class:`DegradedPlacement` runs its
rounds on the cluster's maintenance thread (``ExpertCluster.round_hooks``), never on the
scheduler's.

Shapes: L MoE layers, E logical experts, P physical slots, S servers.
"""

from __future__ import annotations

import logging
import time

import torch

from coordinator.eplb.grow import with_servers
from coordinator.eplb.hetero import rebalance_heterogeneous
from coordinator.eplb.moves import align_servers
from coordinator.eplb.plan import placement_tensors, to_placement
from coordinator.experts.expert_conn import ExpertServerError
from expertmesh import placement as pl

log = logging.getLogger("expertmesh.degraded")


def degraded_placement(
    live: pl.Placement,
    moe_layers: list[int],
    down: frozenset[int],
    capacity: torch.Tensor,  # [S] int64 slots per layer each server holds (its Describe)
    weight: torch.Tensor | None = None,  # [L, E] expert load; None = uniform
) -> pl.Placement:
    """Every expert of every layer on the servers not in ``down`` (they get no slot), as many
    slots per layer as before where capacity allows (replicas of the heaviest experts), experts
    kept on the server that held them where the packing allows; generation ``live + 1``."""
    s, e = len(live.servers), live.num_experts
    cap = capacity.clone().long()
    for i in down:
        cap[i] = 0
    before = max(len(live.layers[layer].phy2log) for layer in moe_layers)
    num_replicas = min(max(before, e), int(cap.sum()))
    if num_replicas < e:
        raise ValueError(
            f"the servers left hold {int(cap.sum())} slots per layer in all, fewer than the {e} experts"
        )
    w = torch.ones(len(moe_layers), e, dtype=torch.float64) if weight is None else weight.double()
    speed = torch.ones(s, dtype=torch.float64)
    phy2log, owner, _ = rebalance_heterogeneous(w, cap, speed, num_replicas)  # [L, P] each
    old = placement_tensors(live, moe_layers)
    if old is not None:
        # NOTE: a down server is its own class: experts are renamed only among live servers
        classes = torch.where(cap > 0, 0, torch.arange(1, s + 1))
        owner = align_servers(old[0], old[1], phy2log, owner, classes, e)
    new = to_placement(live.generation + 1, live.servers, e, moe_layers, phy2log, owner)
    for layer in moe_layers:
        assert not set(new.layers[layer].owner) & set(down), f"{layer=} {down=}"
    return new


class DegradedPlacement:
    """The cluster's round hook: re-place after ``after_s`` of lost coverage; restore when back."""

    def __init__(self, cluster, after_s: float, timeout_s: float) -> None:  # cluster: ExpertCluster
        self.cluster, self.after_s, self.timeout_s = cluster, after_s, timeout_s
        self.saved: pl.Placement | None = None  # the placement before the first degradation
        self._retry_at = 0.0
        cluster.round_hooks.append(self.round)

    def round(self) -> None:
        c = self.cluster
        down = c.down()
        if self.saved is not None and not down:
            self._restore()
            return
        now = time.monotonic()
        if not down or now < self._retry_at:
            return
        long_down = [
            i for i in down if (t := c.members[i].down_since) is not None and now - t >= self.after_s
        ]
        if not long_down or not pl.uncovered(c.placement.tables, down):
            return
        try:
            self._degrade(down)
        except (ValueError, ExpertServerError) as e:
            # NOTE: tried again after another ``after_s`` (no storm of pushes)
            self._retry_at = now + self.after_s
            log.warning("cannot re-place the lost experts: %s", e)

    def _degrade(self, down: frozenset[int]) -> None:
        c = self.cluster
        live = c.placement
        cap = torch.tensor(
            [m.conn.info.slot_capacity if m.conn.info is not None else 0 for m in c.members], dtype=torch.long
        )
        moe_layers = sorted(live.layers)
        new = degraded_placement(live, moe_layers, down, cap)
        lost = pl.uncovered(live.tables, down)
        names = [c.members[i].conn.spec.name for i in sorted(down)]
        log.warning(
            "%s down for %gs+ and %d layers have experts without a live replica: re-placing every expert "
            "over the other servers (generation %d)",
            ", ".join(names),
            self.after_s,
            len(lost),
            new.generation,
        )
        failed = c.update_placement(new, self.timeout_s)
        if self.saved is None:
            self.saved = live
        log.info("degraded placement %d live (commit failed on servers %s)", new.generation, failed)

    def _restore(self) -> None:
        c = self.cluster
        assert self.saved is not None
        # NOTE: servers that joined since hold nothing in it (the next EPLB plan gives them copies)
        restored = with_servers(self.saved, c.placement.servers).with_generation(c.placement.generation + 1)
        log.info(
            "every server is back: restoring the placement before degradation (generation %d)",
            restored.generation,
        )
        c.update_placement(restored, self.timeout_s)
        self.saved = None
