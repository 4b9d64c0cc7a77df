"""Several coordinators sharing one pool of expert servers: which of them places the experts.

Exactly one placement is live on the pool. The coordinator that places experts (pushes
placements: bring-up, EPLB, degraded re-placement, an operator's SetPlacement) holds the
*placement role*; the others follow the generation the servers hold (the cluster adopts it,
coordinator/experts/cluster.py).

The role is a lease on the expert servers themselves (expertmesh/worker/lease.py), so no other
service is needed: every ``ttl/3`` seconds (at most ROUND_S) this module's thread

- as holder, renews the lease on every reachable server; refused anywhere (another coordinator
  holds it there), it gives the role up and releases its leases;
- as follower, looks (observe); when no reachable server reports a live holder, it asks for
  the lease on the servers in address order and stops at the first refusal (two candidates
  meet on the same first server: one wins there, the other stops), releasing what it got if
  refused. A coordinator that got the lease on every server it reaches holds the role.

When the holder dies (kill -9), its leases expire after ``ttl`` seconds and a follower takes the
role at its next round. The servers refuse placement pushes from anyone but the live holder, so
a coordinator that lost the role cannot push a late placement.

Each round also records the highest generation the servers report and the adapters they hold
(MoE LoRA loaded through any coordinator): the cluster adopts a newer placement, the LoRA
service loads adapters it lacks (coordinator/lora/service.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator.experts.expert_conn import ExpertServerError
from expertmesh import placement as pl

log = logging.getLogger("expertmesh.pool")

ROUND_S = 0.5  # the longest time between two lease rounds


class LeaseConn(Protocol):
    """What a round needs of a server's connection (coordinator/experts/expert_conn.py)."""

    def lease(
        self, holder: str, ttl_s: float, timeout: float, release: bool = False, observe: bool = False
    ): ...


@dataclass(frozen=True)
class PoolAdapter:
    name: str
    slot: int
    source: str  # the path the loading coordinator read it from ("" = unknown)


def placement_of_servers(
    generation: int, names: tuple[str, ...], num_experts: int, tables: dict[int, dict[int, list[int]]]
) -> pl.Placement:
    """The placement the servers hold: ``tables`` maps a server's index to its live slot table
    (layer -> logical expert per local slot); a server missing there holds nothing. Raises
    PlacementError when some expert has no slot."""
    per_layer: dict[int, dict[str, list[int]]] = {}
    for i, table in tables.items():
        for layer, experts in table.items():
            per_layer.setdefault(layer, {})[names[i]] = experts
    return pl.from_server_lists(generation, names, num_experts, per_layer)


def coordinator_id() -> str:
    """Unique per process: host, pid and a random part (a restarted coordinator is a new one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class PoolRole:
    def __init__(
        self,
        conns: Callable[[], Sequence[LeaseConn]],
        addresses: Callable[[], Sequence[str]],
        ttl_s: float,
        on_change: Callable[[], None] = lambda: None,
        holder_id: str | None = None,
    ) -> None:
        self.conns, self.addresses, self.ttl_s, self.on_change = conns, addresses, ttl_s, on_change
        self.id = holder_id or coordinator_id()
        self.holder = False  # this coordinator holds the role
        self.seen_holder = ""  # the holder the servers reported last ("" = none)
        self.generation = 0  # the highest placement generation a server reported last round
        self.generations: dict[int, int] = {}  # server index -> its live generation, last round
        self.adapters: dict[str, PoolAdapter] = {}  # the union of what the servers hold
        self.rounds = 0
        self.answered = 0  # servers that answered the last round
        self._cond = threading.Condition()
        self._round_lock = threading.Lock()  # the thread's rounds and a bring-up's
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def period_s(self) -> float:
        """Between two rounds: a third of the lease (renewed twice before it runs out), and
        at most ROUND_S, so followers see a new generation soon after its commit."""
        return min(self.ttl_s / 3, ROUND_S)

    @property
    def timeout_s(self) -> float:
        return max(0.2, min(1.0, self.ttl_s / 4))

    # ------------------------------------------------------------ one round

    def observe_adapters(self) -> dict[str, PoolAdapter]:
        """The adapters the reachable servers hold now (asked now, not at the last round)."""
        out: dict[str, PoolAdapter] = {}
        for c in self.conns():
            try:
                a = c.lease(self.id, self.ttl_s, self.timeout_s, observe=True)
            except ExpertServerError:
                continue
            for ad in a.adapters:
                out.setdefault(ad.name, PoolAdapter(ad.name, ad.adapter_slot, ad.source))
        return out

    def round(self) -> None:
        """Renews (holder) or looks and maybe takes the role (follower); updates what the
        servers report. Never raises for an unreachable server (it is skipped)."""
        with self._round_lock:
            self._round()

    def _round(self) -> None:
        conns = list(self.conns())
        order = sorted(range(len(conns)), key=lambda i: self.addresses()[i])
        was = self.holder
        if self.holder:
            answers = self._ask(conns, order, take=True, stop_at_refusal=False)
            refused = [a for a in answers.values() if not a.granted]
            if refused or not answers:
                self.holder = False
                self._release(conns, order)
        else:
            answers = self._ask(conns, order, take=False, stop_at_refusal=False)
            others = [a.holder for a in answers.values() if a.holder and a.holder != self.id]
            if answers and not others:
                taken = self._ask(conns, order, take=True, stop_at_refusal=True)
                if len(taken) == len(answers) and all(a.granted for a in taken.values()):
                    self.holder = True
                    answers = taken
                else:
                    self._release(conns, order)
                    answers.update(taken)
        holders = {a.holder for a in answers.values() if a.holder}
        self.seen_holder = self.id if self.holder else next(iter(sorted(holders - {self.id})), "")
        self.generations = {i: int(a.generation) for i, a in answers.items()}
        self.generation = max(self.generations.values(), default=self.generation)
        adapters: dict[str, PoolAdapter] = {}
        for a in answers.values():
            for ad in a.adapters:
                adapters.setdefault(ad.name, PoolAdapter(ad.name, ad.adapter_slot, ad.source))
        self.adapters = adapters
        self.answered = len(answers)
        self.rounds += 1
        if self.holder != was:
            log.info("placement role %s (coordinator %s)", "taken" if self.holder else "given up", self.id)
        self.on_change()

    def _ask(self, conns: Sequence[LeaseConn], order: list[int], take: bool, stop_at_refusal: bool) -> dict:
        out = {}
        for i in order:
            try:
                a = conns[i].lease(self.id, self.ttl_s, self.timeout_s, observe=not take)
            except ExpertServerError:
                continue  # unreachable: it counts for nobody
            out[i] = a
            if stop_at_refusal and not a.granted:
                break
        return out

    def _release(self, conns: Sequence[LeaseConn], order: list[int]) -> None:
        for i in order:
            with contextlib.suppress(ExpertServerError):
                conns[i].lease(self.id, self.ttl_s, self.timeout_s, release=True)

    # ------------------------------------------------------------ the thread

    def start(self) -> None:
        with self._cond:
            if self._thread is not None or self._stop:
                return
            self._thread = threading.Thread(target=self._run, daemon=True, name="placement-lease")
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.round()
            except Exception:  # noqa: BLE001 - the thread's boundary: it must outlive any bug
                log.exception("placement lease round failed")
            with self._cond:
                self._cond.wait(self.period_s)
                if self._stop:
                    return

    def close(self) -> None:
        """Stops the thread and gives the role up (the others take it at once, not after ttl)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        if self.holder:
            conns = list(self.conns())
            self._release(conns, list(range(len(conns))))
            self.holder = False
