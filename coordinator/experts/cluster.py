"""The expert servers as one cluster: their connections, their states, the live placement, and
how all of that changes (bring-up, reconnection, two-phase broadcasts), all off the step path.

:class:`ExpertCluster` owns one connection per server (coordinator/experts/expert_conn.py) and a
:class:`ServerState` per server. A maintenance thread does every slow thing: the first
bring-up (Describe, health wait, placement prepare + commit on all servers, streams), and the
reconnection of a server whose stream died (re-pushing the live placement if it restarted).
The forward step only asks :meth:`ensure_ready` (wait, bounded, for the thread; never a
Describe, health wait or placement push on the step's thread) and reads
:attr:`tables` (one placement generation per step).

Members are added at run time, never removed (coordinator/experts/membership.py: a server
found through its DNS name joins holding no slot; one that leaves is routed around).

:meth:`two_phase` is the generic broadcast (prepare on all, abort on any failure, commit on
all) that placement changes use (:meth:`update_placement`) and adapter loads will use.

The connection is passed in as a factory so the state machine is tested with fake
connections (tests/test_cluster_state.py). No gRPC here: connections raise
:class:`ExpertServerError`, which carries a typed error.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from coordinator.experts import dns
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from coordinator.experts.expert_conn import ExpertServerError, ServerConnection
from coordinator.experts.membership import DnsMembership
from coordinator.experts.pool import PoolRole, placement_of_servers
from expertmesh import errors
from expertmesh import placement as pl
from expertmesh.config import ModelConfig
from expertmesh.net import device_uuid, host_id
from expertmesh.transport import negotiate
from expertmesh.worker_api import WorkerInfo

log = logging.getLogger("expertmesh.cluster")

RECONNECT_WAIT_S = 5.0  # at most this long (or the expert timeout) a step waits for a reconnect
BETWEEN_STEPS_WAIT_S = 60.0  # a commit phase waits this long for the scheduler to reach a gap


class Adopting(ExpertServerError):
    """A follower found a server on a newer placement generation than its own and is adopting
    it (between two steps): a step that needs that server's experts is refused as stale at
    once, not held for it, since the adoption waits for the steps to leave a gap."""


class NotRun(ExpertServerError):
    """The switch between two steps never ran (the steps left no gap in time): nothing moved."""


POLL_S = 0.5  # the maintenance thread looks at every server this often


class ServerState(Enum):
    CONNECTING = "connecting"  # never brought up yet
    READY = "ready"  # placement committed, stream open
    UNAVAILABLE = "unavailable"  # failed; the maintenance thread is bringing it back


class Connection(Protocol):
    """What the cluster needs of one server's connection (coordinator/experts/expert_conn.py)."""

    spec: ServerSpec
    info: WorkerInfo | None
    on_down: Callable[[ExpertServerError], None]

    def describe(self, timeout: float) -> WorkerInfo: ...
    def plan_transport(self, info: WorkerInfo, local: negotiate.Side) -> None: ...
    def wait_serving(self, deadline: float) -> None: ...
    def prepare(self, generation: int, table: dict[int, list[int]], timeout: float) -> None: ...
    def commit(self, generation: int, timeout: float) -> None: ...
    def abort(self, generation: int, timeout: float) -> None: ...
    def load_adapter(
        self, adapter_slot: int, name: str, tensors: dict, timeout: float, source: str = ""
    ) -> None: ...
    def unload_adapter(self, name: str, timeout: float) -> None: ...
    # servers shared by several coordinators (coordinator/experts/pool.py)
    def lease(
        self, holder: str, ttl_s: float, timeout: float, release: bool = False, observe: bool = False
    ): ...
    def live_placement(self, timeout: float) -> tuple[int, dict[int, list[int]]]: ...
    def expert_tokens(self, timeout: float) -> dict[int, list[int]]: ...
    def open_stream(self) -> object: ...
    def stream_alive(self) -> bool: ...
    def serving(self, timeout: float) -> bool: ...
    def retire_stream(self, reason: str, timeout: float) -> None: ...
    def retarget(self, address: str) -> None: ...
    def reset(self, reason: str) -> None: ...
    def close(self) -> None: ...


@dataclass
class Member:
    conn: Connection
    state: ServerState = ServerState.CONNECTING
    last_error: str = ""
    error: ExpertServerError | None = None
    down_since: float | None = None  # monotonic time it was last lost (None: up)
    gone: bool = False  # its address left its DNS name: not reconnected until one comes back
    draining: bool = False  # its health said NOT_SERVING (SIGTERM): leaving until it serves again
    joined: bool = False  # holds no slot since it joined (found at run time, or came back after
    # its experts were re-placed): EPLB's next plan gives it replicas first (coordinator/eplb/grow.py)


def initial_placement(cfg: ModelConfig, c: ClusterConfig) -> pl.Placement:
    names = tuple(s.name for s in c.servers)
    if c.placement_file:
        return pl.load_file(c.placement_file, cfg.moe_layer_ids, cfg.num_experts, names)
    n = c.num_gpu_experts
    if n is None:
        n = cfg.num_experts if not c.cpu else 0 if not c.gpu else cfg.num_experts // 2
    return pl.static_split(
        cfg.moe_layer_ids, cfg.num_experts, [s.name for s in c.gpu], [s.name for s in c.cpu], n
    )


class ExpertCluster:
    def __init__(
        self,
        model_config: ModelConfig,
        config: ClusterConfig,
        device: torch.device | str = "cpu",
        connect: Callable[[ServerSpec], Connection] | None = None,
        local_side: negotiate.Side | None = None,
        resolver: dns.Resolver | None = None,
        local: Callable[[ServerSpec], Connection] | None = None,
    ) -> None:
        """``local`` makes the in-process member (coordinator/experts/local.py ``connector``)."""
        if not config.servers:
            raise ValueError("an expert cluster needs at least one expert server")
        self.cfg, self.config, self.device = model_config, config, torch.device(device)

        def remote(spec: ServerSpec) -> Connection:
            if not spec.in_process:
                return ServerConnection(spec, config, self.device)
            if local is None:
                raise ValueError(f"the in-process member {spec.name!r} needs the coordinator's checkpoint")
            return local(spec)

        self._make = connect or remote
        # NOTE: replaced, never changed in place, when a server joins (readers on other threads
        # iterate the list they got); indices are stable: a member is never removed
        self.members = [Member(self._make(spec)) for spec in config.servers]
        for i, m in enumerate(self.members):
            m.conn.on_down = self._down_hook(i)
        self.local_side = local_side or negotiate.Side(
            host_id(), device_uuid(self.device), ("shm", "cuda_ipc")
        )
        full = None
        if config.gpu_prefill_token_threshold:
            full = next(i for i, s in enumerate(config.servers) if s.kind == "gpu")
        self._full_server = full
        self.tables = pl.server_tables(initial_placement(model_config, config), full)
        self._placed = False  # our placement generation is committed on every server
        self._serving = False  # a placement was committed once: steps may run from now on
        # how the commit phase of a broadcast reaches a point between two steps once serving
        # (coordinator/serving/server.py sets Scheduler.call_between_steps); None: commit at once
        self.between_steps: Callable[[Callable[[], None]], Future] | None = None
        self._cond = threading.Condition()
        self._kicked = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._connect_timeout_s = 10.0
        self.membership = DnsMembership(
            self, resolver or dns.resolver_for(config.dns_hosts_file), config.dns_refresh_s
        )
        # a placement push and a server joining exclude each other (both change the server list
        # the placement is over)
        self._push_lock = threading.RLock()
        self._readopt = False  # a follower adopts the live placement again (a server joined)
        # run after each member's PREPARE with (member, its new slot table, timeout): state that
        # must travel with a placement (MoE LoRA adapters of the experts it will hold) goes here
        self.prepare_hooks: list[Callable[[int, dict[int, list[int]], float], None]] = []
        # run at the end of every maintenance round, once serving, whether the round's
        # reconnections worked or not (coordinator/eplb/degraded.py re-places experts from here)
        self.round_hooks: list[Callable[[], None]] = []
        # several coordinators share these servers: who places experts (coordinator/experts/pool.py)
        self.pool: PoolRole | None = None
        self._last_push = 0.0  # monotonic time of this coordinator's last placement push
        if config.placement_lease_s > 0:
            self.pool = PoolRole(
                lambda: self.conns,
                lambda: [m.conn.spec.address for m in self.members],
                config.placement_lease_s,
                self._pool_changed,
            )
            for c in self.conns:
                c.lease_holder = self.pool.id  # type: ignore[attr-defined]  # NOTE: ServerConnection's

    def add_member(self, spec: ServerSpec) -> int:
        """A server found at run time joins (coordinator/experts/membership.py): it holds no slot
        in the live placement (same generation, one more server) until the next push gives it
        some; the maintenance thread brings it up. Returns its index."""
        conn = self._make(spec)
        # NOTE: the same link offer as the servers this coordinator started with (the remote
        # dispatcher sets their shape: a CUDA coordinator's)
        shape = next((s for m in self.members if (s := getattr(m.conn, "link_shape", None))), None)
        if shape is not None and hasattr(conn, "link_shape"):
            conn.link_shape = shape
        with self._push_lock, self._cond:
            i = len(self.members)
            conn.on_down = self._down_hook(i)
            if self.pool is not None:
                conn.lease_holder = self.pool.id  # type: ignore[attr-defined]  # NOTE: ServerConnection's
            p = self.placement
            grown = pl.Placement(p.generation, (*p.servers, spec.name), p.num_experts, p.layers)
            self.tables = pl.server_tables(grown, self._full_server)
            self.members = [*self.members, Member(conn, joined=True)]
            # NOTE: a follower reads the servers' tables again: the holder may have given this
            # server slots in the live generation before this coordinator resolved it
            self._readopt = self.pool is not None and self._placed
        self.kick()
        return i

    def leaving(self) -> frozenset[int]:
        """Servers on their way out: draining (SIGTERM) or their address left their DNS name."""
        return frozenset(i for i, m in enumerate(self.members) if m.draining or m.gone)

    def joining(self) -> frozenset[int]:
        """Usable servers that joined (or came back empty) and hold no slot yet."""
        p = self.placement
        return frozenset(
            i
            for i, m in enumerate(self.members)
            if m.joined
            and self._usable(m)
            and not (m.draining or m.gone)
            and not any(p.server_slots(i).values())
        )

    # ------------------------------------------------------------ reading

    @property
    def placement(self) -> pl.Placement:
        return self.tables.placement

    @property
    def conns(self) -> list[Connection]:
        return [m.conn for m in self.members]

    def holds_role(self) -> bool:
        """Whether this coordinator places experts (always, unless it shares the servers)."""
        return self.pool is None or self.pool.holder

    def _pool_changed(self) -> None:
        """After a lease round: the maintenance thread adopts a newer generation at once."""
        if self.pool is not None and self._placed and self.pool.generation > self.tables.generation:
            self._kick()

    def ready(self) -> bool:
        return all(m.state is ServerState.READY for m in self.members)

    def _usable(self, m: Member) -> bool:
        return m.state is ServerState.READY and m.conn.stream_alive()

    def server_infos(self) -> list[dict]:
        out = []
        tables = self.tables
        for i, m in enumerate(self.members):
            c, info = m.conn, m.conn.info
            out.append(
                dict(
                    name=c.spec.name,
                    address=c.spec.address,
                    kind=c.spec.kind,
                    state=m.state.value,
                    device=info.device if info else "",
                    weight_dtype=info.weight_dtype if info else "",
                    slot_capacity=info.slot_capacity if info else 0,
                    # NOTE: what the live placement gives it (a follower never pushes one itself)
                    slots_used=tables.slots_needed(i) if i < len(tables.slots) else 0,
                    transport=getattr(c, "transport", "grpc"),
                    transport_note=getattr(c, "transport_note", ""),
                    fast_fallbacks=getattr(c, "fast_fallbacks", 0),
                    link=_link_kind(c),
                    link_note=getattr(c, "link_pause", "") or getattr(c, "link_note", ""),
                    relay=c.relays.totals() if hasattr(c, "relays") else {},
                    last_error=m.last_error,
                )
            )
        return out

    def describe_state(self) -> str:
        return ", ".join(
            f"{m.conn.spec.name} {m.state.value}"
            + (" (stream closed)" if m.state is ServerState.READY and not m.conn.stream_alive() else "")
            + (f" ({m.last_error})" if m.last_error else "")
            for m in self.members
        )

    # ------------------------------------------------------------ state changes

    def _set(self, i: int, state: ServerState, error: ExpertServerError | str | None = None) -> None:
        with self._cond:
            m = self.members[i]
            m.state = state
            if state is ServerState.READY:
                m.down_since = None
                m.draining = False
            elif m.down_since is None:
                m.down_since = time.monotonic()
            if isinstance(error, ExpertServerError):
                m.error, m.last_error = error, str(error)
            elif error is not None:
                m.last_error = error
            elif state is ServerState.READY:
                m.error, m.last_error = None, ""
            self._cond.notify_all()

    def _down_hook(self, i: int) -> Callable[[ExpertServerError], None]:
        def down(err: ExpertServerError) -> None:  # a connection's reader thread
            self.mark_down(i, err)

        return down

    def mark_down(self, i: int, error: ExpertServerError | str) -> None:
        """Server ``i`` failed (its stream died, it timed out): the maintenance thread brings it back."""
        self._set(i, ServerState.UNAVAILABLE, error)
        self.kick()

    def kick(self) -> None:
        """Wakes the maintenance thread for a round now."""
        self._kick()

    def _kick(self) -> None:
        with self._cond:
            self._kicked = True
            self._cond.notify_all()

    def down(self) -> frozenset[int]:
        """Servers a step cannot use now (not READY, or their stream died)."""
        return frozenset(i for i, m in enumerate(self.members) if not self._usable(m))

    def covered(self) -> bool:
        """Whether every expert of every layer has a replica on a usable server."""
        down = self.down()
        return not down or not pl.uncovered(self.tables.placement.tables, down)

    def outage_wait(self, wait_s: float) -> float:
        """How long a step that needs a lost expert may still wait for it: ``wait_s`` from the
        latest loss, so requests are held only at the start of an outage (a quick restart
        rejoins in time), never ``wait_s`` per step all through it."""
        since = [m.down_since for m in self.members if m.down_since is not None]
        if not since:
            return wait_s
        return max(0.0, min(wait_s, max(since) + wait_s - time.monotonic()))

    @property
    def serving(self) -> bool:
        """Whether a placement was committed on every server once (steps may run)."""
        return self._serving

    def serving_some(self) -> bool:
        """Whether requests may be admitted: the placement was live once and some server is
        usable (a request that needs only live servers' experts succeeds; the others fail at
        their layer with a status naming the lost experts)."""
        return self._serving and len(self.down()) < len(self.members)

    def ensure_ready(self, wait_s: float) -> frozenset[int]:
        """Returns the servers to route around (empty when all are up). A down server whose
        experts all have live replicas elsewhere is routed around at once; otherwise this waits
        at most ``wait_s`` for the maintenance thread, then raises (UNAVAILABLE naming the
        experts without a live server, or the incompatibility that keeps a server out). The
        step path uses :meth:`step_down` (no wait once serving)."""
        if all(self._usable(m) for m in self.members):  # the common case: no lock
            return frozenset()
        return self._wait_covered(wait_s, wait_lost=True)

    def step_down(self, wait_s: float) -> frozenset[int]:
        """Before a step: the servers it must route around, at once once the cluster serves:
        a step whose tokens need an expert without a live replica fails at that layer
        (:meth:`lost_experts`) and the others go on. Before the first placement is live this
        is :meth:`ensure_ready` (the bounded wait for the bring-up)."""
        if all(self._usable(m) for m in self.members):  # the common case: no lock
            return frozenset()
        # NOTE: once serving, a step never waits for a lost server (requests that do not need
        # its experts go on; the others fail at once with a status naming them)
        return self._wait_covered(wait_s, wait_lost=not self._serving)

    def _wait_covered(self, wait_s: float, wait_lost: bool) -> frozenset[int]:
        self.start()
        deadline = time.monotonic() + wait_s
        with self._cond:
            self._kicked = True
            self._cond.notify_all()
            while True:
                down = self.down()
                lost = pl.uncovered(self.tables.placement.tables, down) if down else {}
                if not lost or (not wait_lost and not self._incompatible(down)):
                    return down
                adopting = [e for i in sorted(down) if isinstance(e := self.members[i].error, Adopting)]
                if self._serving and len(adopting) == len(down):
                    # NOTE: the adoption swaps tables between two steps, so a step held for it
                    # would hold the adoption too: refused now, the step runs again after
                    raise adopting[0]
                left = deadline - time.monotonic()
                if left <= 0 or not wait_lost:
                    break
                # NOTE: a dead stream is not signalled through the condition: poll it too
                self._cond.wait(min(left, 0.05))
        bad = [self.members[i] for i in sorted(down)]
        for m in bad:
            if m.error is not None and isinstance(m.error.error, errors.Incompatible):
                raise m.error
        layer, experts = next(iter(sorted(lost.items())))
        more = f" (and {len(lost) - 1} more layers)" if len(lost) > 1 else ""
        raise self.lost_experts(layer, experts, down, more)

    def _incompatible(self, down: frozenset[int]) -> bool:
        return any(
            (e := self.members[i].error) is not None and isinstance(e.error, errors.Incompatible)
            for i in down
        )

    def lost_experts(
        self, layer: int, experts: list[int], down: frozenset[int], more: str = ""
    ) -> ExpertServerError:
        """UNAVAILABLE for a step that needs ``experts`` of ``layer`` while every replica of
        them is on a server in ``down``: names the experts, the servers and why they are out."""
        t = self.tables.placement.tables[layer]
        holders = sorted({int(t.owner[p]) for e in experts for p in t.log2phy[e].tolist() if p >= 0})
        names = []
        for i in holders or sorted(down):
            m = self.members[i]
            why = m.last_error or ("connecting" if m.state is ServerState.CONNECTING else "stream closed")
            names.append(f"expert server {m.conn.spec.name} ({m.conn.spec.address}) is not ready: {why}")
        return ExpertServerError.of(
            errors.Unavailable(
                f"{'; '.join(names)}; no live server holds layer {layer} experts {experts}{more}"
            )
        )

    # ------------------------------------------------------------ bring-up

    def connect(self, timeout_s: float = 60.0) -> None:
        """The first bring-up, on the caller's thread (raises if it fails); then the
        maintenance thread keeps the servers up."""
        self._connect_all(time.monotonic() + timeout_s)
        self.start(timeout_s)

    def start(self, connect_timeout_s: float | None = None) -> None:
        """Starts the maintenance thread (idempotent): it does the first bring-up if
        :meth:`connect` did not, retrying every ``connect_timeout_s``, then reconnects."""
        with self._cond:
            if connect_timeout_s is not None:
                self._connect_timeout_s = connect_timeout_s
            if self._thread is not None or self._stop:
                return
            if self.pool is not None:
                self.pool.start()
            self._kicked = True  # the first round at once
            self._thread = threading.Thread(target=self._maintain, daemon=True, name="expert-cluster")
        self._thread.start()

    def _connect_all(self, deadline: float) -> None:
        """Numbers a placement above every server's and pushes it to all (two phases): the
        first bring-up, and the renumbering after a server was found holding a newer one."""
        infos = [self._guard(i, lambda c: _describe_until(c, deadline)) for i, c in enumerate(self.conns)]
        if self.pool is not None and self._join_pool(infos, deadline):
            return
        for i, info in enumerate(infos):
            if info.generation >= pl.MAX_GENERATION:
                err = ExpertServerError.of(
                    errors.Incompatible(
                        f"{self.conns[i].spec.name} holds placement generation {info.generation}, at or above "
                        f"the largest allowed ({pl.MAX_GENERATION}): it was pushed a bogus placement; restart it"
                    )
                )
                self._set(i, ServerState.UNAVAILABLE, err)
                raise err
        # NOTE: a new coordinator's placement must be newer than whatever the servers hold
        # (they may have served an earlier coordinator), so numbering continues from theirs.
        gen = max([self.placement.generation - 1, *(i.generation for i in infos)]) + 1
        tables = pl.server_tables(self.placement.with_generation(gen), self._full_server)

        def left() -> float:
            return max(1.0, deadline - time.monotonic())

        def swap() -> None:
            with self._cond:
                self.tables = tables

        failed = self.two_phase(
            prepare=lambda i: self._prepare_member(i, tables, deadline),
            commit=lambda i: self._guard(i, lambda c: c.commit(gen, left())),
            abort=lambda i: self.conns[i].abort(gen, left()),
            swap=swap,
        )
        if failed:
            first = self.members[failed[0]].error
            assert first is not None
            raise first
        for i in range(len(self.members)):
            self._guard(i, lambda c: c.open_stream())
            self._set(i, ServerState.READY)
        self._placed = self._serving = True
        self._last_push = time.monotonic()

    def _prepare_member(self, i: int, tables: pl.ServerTables, deadline: float) -> bool:
        """Describe, check, choose the data path, wait for health, and prepare the placement
        if the server does not hold it yet (returns whether it did)."""
        info = self._guard(i, lambda c: _describe_until(c, deadline))
        self._guard(i, lambda c: self._check(c, info, tables.slots_needed(i)))
        self._guard(i, lambda c: c.plan_transport(info, self.local_side))
        self._guard(i, lambda c: c.wait_serving(deadline))
        if info.generation == tables.generation:
            return False
        if self.pool is not None and not self.pool.holder:
            self._guard(i, lambda c: self._follower_waits(c, info.generation, tables.generation))
        if info.generation > tables.generation and self._placed:
            # NOTE: someone else (another coordinator, a third party) committed a newer
            # generation there: ours can no longer be pushed, so all servers are renumbered
            self._placed = False
            self._kick()
            raise ExpertServerError.of(
                errors.StaleGeneration(
                    f"{self.conns[i].spec.name} holds placement generation {info.generation}, newer than "
                    f"ours ({tables.generation}): renumbering the placement on every server"
                )
            )
        left = max(1.0, deadline - time.monotonic())
        self._guard(i, lambda c: c.prepare(tables.generation, tables.slots[i], left))
        self._guard(i, lambda c: self._after_prepare(i, tables.slots[i], left))
        return True

    def _after_prepare(self, i: int, table: dict[int, list[int]], timeout: float) -> None:
        for hook in self.prepare_hooks:
            hook(i, table, timeout)

    def _bring_back(self, i: int, deadline: float) -> None:
        """Reconnects one server: the live placement prepared and committed if it lacks it."""
        tables = self.tables
        if self._prepare_member(i, tables, deadline):
            left = max(1.0, deadline - time.monotonic())
            self._guard(i, lambda c: c.commit(tables.generation, left))
        self._guard(i, lambda c: c.open_stream())
        self._set(i, ServerState.READY)

    def _check(self, conn: Connection, info: WorkerInfo, need: int) -> None:
        cfg = self.cfg
        want = (cfg.model_type, cfg.hidden_size, cfg.num_experts, list(cfg.moe_layer_ids))
        got = (info.model_type, info.hidden_size, info.num_experts, list(info.moe_layers))
        if want != got:
            raise ExpertServerError.of(
                errors.Incompatible(
                    f"{conn.spec.name} serves a different model: (model_type, hidden, experts, moe layers) {got}, expected {want}"
                )
            )
        if need > info.slot_capacity:
            raise ExpertServerError.of(
                errors.Incompatible(
                    f"{conn.spec.name} holds at most {info.slot_capacity} slots per layer, the placement gives it {need}"
                )
            )

    def _guard(self, i: int, fn: Callable[[Connection], object]):
        """Runs ``fn`` on server ``i``'s connection; a failure marks the server UNAVAILABLE."""
        try:
            return fn(self.conns[i])
        except ExpertServerError as e:
            self._set(i, ServerState.UNAVAILABLE, e)
            raise

    def _maintain(self) -> None:
        last = ""
        while True:
            with self._cond:
                if not self._kicked and not self._stop:
                    self._cond.wait(POLL_S)
                self._kicked = False
                if self._stop:
                    return
            try:
                self.membership.refresh()
                if not self._placed:
                    self._connect_all(time.monotonic() + self._connect_timeout_s)
                else:
                    if self.pool is not None and (
                        self.pool.generation > self.tables.generation
                        or (self._readopt and not self.pool.holder)
                    ):
                        self._adopt(time.monotonic() + self._reconnect_s())
                    self._readopt = False
                    failed = self._bring_back_all()
                    self._watch_draining()
                    if failed is not None:
                        raise failed
                last = ""
            except ExpertServerError as e:
                if str(e) != last:
                    log.warning("expert servers not ready: %s", e)
                last = str(e)
                time.sleep(0.2)  # a server that refuses at once is not hammered
            except Exception as e:  # noqa: BLE001 - the thread's boundary: it must outlive any bug
                log.exception("expert-cluster maintenance round failed")
                last = f"{type(e).__name__}: {e}"
                with self._cond:
                    for m in self.members:
                        if m.state is not ServerState.READY:
                            m.last_error = f"internal error while reconnecting: {last}"
                time.sleep(0.5)
            if self._serving and not self._stop:
                self._run_round_hooks()

    def _run_round_hooks(self) -> None:
        for hook in self.round_hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - the thread's boundary: a hook's bug must not end it
                log.exception("expert-cluster round hook %r failed", hook)

    def _bring_back_all(self) -> ExpertServerError | None:
        """Reconnects every server that is down (one failing does not hold up the others, e.g.
        one that joined); returns the first failure. A leaving server is left alone: one gone
        from its name until its address returns, a drained one is tried briefly (it is back
        once it serves again, e.g. restarted on its port)."""
        first: ExpertServerError | None = None
        for i, m in enumerate(self.members):
            if self._usable(m) or m.gone or self._stop:
                continue
            wait = min(1.0, self._reconnect_s()) if m.draining else self._reconnect_s()
            try:
                self._bring_back(i, time.monotonic() + wait)
            except ExpertServerError as e:
                first = first or e
        return first

    def _watch_draining(self) -> None:
        """A ready server whose health turned NOT_SERVING is draining (SIGTERM): it is leaving
        (the placement holder re-places its experts, coordinator/eplb/drain.py). Steps route
        around it as soon as every expert it holds has a live replica elsewhere: at once when
        it had, else once the re-placement is live here (a draining server still answers its
        open streams). Then its stream is closed once its in-flight answers are in, so that it
        may exit (the reconnection waits for it to serve again)."""
        for i, m in enumerate(self.members):
            if self._stop or m.state is not ServerState.READY:
                continue
            if not m.draining:
                serving = getattr(m.conn, "serving", None)  # NOTE: test fakes have no health
                if serving is None or serving(min(1.0, self.config.timeout_s)):
                    continue
                m.draining = True
                log.info("%s reports NOT_SERVING (draining)", m.conn.spec.name)
                with self._cond:  # what ListServers and the status show while it still serves
                    m.last_error = "draining (health NOT_SERVING): serving until its experts are re-placed"
            lost = pl.uncovered(self.tables.placement.tables, self.down() | {i})
            if lost:
                continue  # NOTE: still routed to: its experts' only live copies are there
            log.info(
                "%s draining: its experts have live copies elsewhere, routing around it", m.conn.spec.name
            )
            self._set(i, ServerState.UNAVAILABLE, "draining (health NOT_SERVING)")
            m.conn.retire_stream("draining", self.config.timeout_s)

    def _reconnect_s(self) -> float:
        return min(RECONNECT_WAIT_S, self.config.timeout_s)

    # ------------------------------------------------------------ a shared pool

    def _join_pool(self, infos: list[WorkerInfo], deadline: float) -> bool:
        """Bring-up on a shared pool: adopts the placement every server holds (True), or
        lets the placement holder push its own (False, when that is us); a follower waits."""
        assert self.pool is not None
        self.pool.round()
        gens = {info.generation for info in infos}
        if gens == {0} or len(gens) > 1:
            if self.pool.holder:
                return False  # the first coordinator of a fresh pool, or a holder fixing a mixed one
            raise ExpertServerError.of(
                errors.Unavailable(
                    f"the expert servers hold placement generations {sorted(gens)}: waiting for the "
                    f"placement holder ({self.pool.seen_holder or 'none yet'}) to push one to all of them"
                )
            )
        self._adopt(deadline)
        for i, info in enumerate(infos):
            self._guard(i, functools.partial(self._check, info=info, need=self.tables.slots_needed(i)))
            self._guard(i, functools.partial(_plan_transport, info=info, local=self.local_side))
            self._guard(i, lambda c: c.wait_serving(deadline))
            self._guard(i, lambda c: c.open_stream())
            self._set(i, ServerState.READY)
        self._placed = self._serving = True
        return True

    def _follower_waits(self, conn: Connection, theirs: int, ours: int) -> None:
        """A follower never pushes: a server with another generation is adopted (newer) or
        waited for (the holder re-pushes to a server that restarted)."""
        assert self.pool is not None
        if theirs > ours:
            self._kick()
            raise Adopting.of(
                errors.StaleGeneration(
                    f"{conn.spec.name} holds placement generation {theirs}, newer than ours ({ours}): adopting it"
                )
            )
        raise ExpertServerError.of(
            errors.Unavailable(
                f"{conn.spec.name} holds placement generation {theirs}: waiting for the placement "
                f"holder ({self.pool.seen_holder or 'none yet'}) to push generation {ours} to it"
            )
        )

    def _adopt(self, deadline: float) -> None:
        """Takes the placement the servers hold as ours (between two steps once serving): every
        server that answers must hold the same generation; one that does not answer holds
        nothing in it (the holder placed around it, or it is gone)."""
        got: dict[int, tuple[int, dict[int, list[int]]]] = {}
        for i, m in enumerate(self.members):
            if m.gone or m.draining:
                continue  # NOTE: a leaving server is pushed nothing more: it keeps an old generation
            c = m.conn
            try:
                got[i] = c.live_placement(max(0.5, min(2.0, deadline - time.monotonic())))
            except ExpertServerError:
                continue
        # NOTE: a server that never held a placement (it just joined) holds nothing in it
        got = {i: a for i, a in got.items() if a[0] != 0} or got
        gens = sorted({g for g, _ in got.values()})
        if len(gens) != 1 or gens[0] == 0:
            if self.pool is not None and self.pool.holder and self._placed:
                # NOTE: the last holder died between its commits (or a server restarted since):
                # the holder renumbers its placement on every server, as at a bring-up
                self._placed = False
                self._kick()
            raise ExpertServerError.of(
                errors.Unavailable(
                    f"the expert servers hold placement generations {gens}: waiting for the placement "
                    "holder's commit to reach all of them"
                )
            )
        names = tuple(m.conn.spec.name for m in self.members)
        try:
            placement = placement_of_servers(
                gens[0], names, self.cfg.num_experts, {i: t for i, (_, t) in got.items()}
            )
        except pl.PlacementError as e:
            raise ExpertServerError.of(
                errors.Unavailable(f"the placement the expert servers hold cannot serve: {e}")
            ) from None
        tables = pl.server_tables(placement, self._full_server)

        def swap() -> None:
            with self._cond:
                self.tables = tables

        self._run_between_steps(swap)
        log.info("following placement generation %d of the shared expert servers", gens[0])

    # ------------------------------------------------------------ broadcasts

    def two_phase(
        self,
        prepare: Callable[[int], object],
        commit: Callable[[int], object],
        abort: Callable[[int], object],
        members: Sequence[int] | None = None,
        swap: Callable[[], object] | None = None,
        between_steps: Callable[[Callable[[], None]], Future] | None = None,
    ) -> list[int]:
        """Prepare on every member (all or nothing: a failure aborts the prepared ones and
        raises), then ``swap`` (what the coordinator itself switches to) and commit on every
        member, between two steps once the cluster serves (:attr:`between_steps`). A member
        whose commit fails is marked down (its reconnection re-pushes what is live) and
        returned; the others are committed."""
        idx = list(range(len(self.members)) if members is None else members)
        prepared: list[int] = []

        def abort_prepared(also: int | None = None) -> None:
            # NOTE: any failure, not only a server's answer (a closed channel raises ValueError);
            # the member whose prepare failed too: one that timed out may still be loading
            for i in [*prepared, *([] if also is None else [also])]:
                with contextlib.suppress(Exception):
                    abort(i)

        for i in idx:
            try:
                prepare(i)
            except Exception:
                abort_prepared(i)
                raise
            prepared.append(i)
        failed: list[int] = []

        def commit_one(i: int) -> None:
            try:
                commit(i)
            except Exception as e:  # noqa: BLE001 - not only a server's answer: none may go unreported
                err = e if isinstance(e, ExpertServerError) else f"commit: {type(e).__name__}: {e}"
                self.mark_down(i, err)
                failed.append(i)

        def commit_all() -> None:
            if swap is not None:
                swap()
            # NOTE: the servers commit at once, so the steps wait for the slowest commit, not
            # for their sum (a commit that rewrites slots takes tens to hundreds of ms). The
            # in-process member commits on this thread: its GPU work and tensor state stay
            # with the thread that runs the steps.
            here = [i for i in idx if getattr(self.conns[i].spec, "in_process", False)]
            remote = [i for i in idx if i not in here]
            threads = [threading.Thread(target=commit_one, args=(i,), name=f"commit-{i}") for i in remote[1:]]
            for t in threads:
                t.start()
            for i in [*remote[:1], *here]:
                commit_one(i)
            for t in threads:
                t.join()

        try:
            self._run_between_steps(commit_all, between_steps)
        except NotRun:
            abort_prepared()
            raise
        return failed

    def _run_between_steps(
        self, fn: Callable[[], None], hook: Callable[[Callable[[], None]], Future] | None = None
    ) -> None:
        """Runs ``fn`` between two steps through ``hook`` (default :attr:`between_steps`), or at
        once before the first placement is live (no step runs yet) or without a hook."""
        if hook is None:
            hook = self.between_steps if self._serving else None
        if hook is None:
            fn()
            return
        fut = hook(fn)
        try:
            fut.result(timeout=BETWEEN_STEPS_WAIT_S)
        except concurrent.futures.TimeoutError:
            if fut.cancel():  # NOTE: not started: it never runs (no late switch behind our back)
                raise NotRun.of(
                    errors.Unavailable(
                        f"the steps left no gap for the switch within {BETWEEN_STEPS_WAIT_S:g}s; nothing was switched"
                    )
                ) from None
            fut.result()  # started meanwhile: its commits end within their own deadlines

    def update_placement(
        self,
        new: pl.Placement,
        timeout_s: float,
        between_steps: Callable[[Callable[[], None]], Future] | None = None,
    ) -> list[int]:
        """Pushes ``new`` (a newer generation, same servers) to every ready server: prepare on
        all on the caller's thread (loads weights; serving goes on), then the swap of
        :attr:`tables` and the commits together, between two steps (:attr:`between_steps`) so
        that no step sees two generations (``between_steps`` overrides the cluster's hook). Call
        it off the scheduler thread. Returns the
        servers whose commit failed; a server that was down gets the new generation when it
        comes back."""
        with self._push_lock:  # NOTE: no server joins meanwhile (the server list is fixed)
            return self._update_placement(new, timeout_s, between_steps)

    def _update_placement(
        self,
        new: pl.Placement,
        timeout_s: float,
        between_steps: Callable[[Callable[[], None]], Future] | None,
    ) -> list[int]:
        if self.pool is not None and not self.pool.holder:
            raise ExpertServerError.of(
                errors.StaleGeneration(
                    f"coordinator {self.pool.seen_holder or '(none yet)'} holds the placement role of "
                    f"these expert servers; this one ({self.pool.id}) follows it and pushes no placement"
                )
            )
        if new.generation <= self.placement.generation or new.servers != self.placement.servers:
            raise ValueError(
                f"placement generation {new.generation} over servers {new.servers} cannot replace "
                f"generation {self.placement.generation} over {self.placement.servers}"
            )
        new.validate()
        tables = pl.server_tables(new.with_generation(new.generation), self._full_server)
        gen = tables.generation
        for i, c in enumerate(self.conns):
            if c.info is not None:
                self._check(c, c.info, tables.slots_needed(i))
        # NOTE: a draining server still serves the live generation but is pushed nothing more
        live = [i for i, m in enumerate(self.members) if m.state is ServerState.READY and not m.draining]
        for i, m in enumerate(self.members):
            if m.draining and m.state is ServerState.READY and any(new.server_slots(i).values()):
                raise ValueError(f"{m.conn.spec.name} is draining: a placement cannot give it experts")

        def swap() -> None:
            with self._cond:
                self.tables = tables
                for i, m in enumerate(self.members):
                    m.joined = m.joined and not any(tables.slots[i].values())

        def prepare(i: int) -> None:
            self.conns[i].prepare(gen, tables.slots[i], timeout_s)
            self._after_prepare(i, tables.slots[i], timeout_s)  # e.g. LoRA of moved experts

        if self.pool is not None:
            # NOTE: a commit makes the servers forget the generation before the live one: the
            # followers get two lease rounds after our last commit to switch off it first
            time.sleep(max(0.0, self._last_push + self.pool.period_s * 2 + 0.5 - time.monotonic()))
        try:
            return self.two_phase(
                prepare=prepare,
                commit=lambda i: self.conns[i].commit(gen, timeout_s),
                abort=lambda i: self.conns[i].abort(gen, timeout_s),
                members=live,
                swap=swap,
                between_steps=between_steps,
            )
        finally:
            self._last_push = time.monotonic()

    def close(self) -> None:
        if self.pool is not None:  # NOTE: first: another coordinator takes the role at once
            self.pool.close()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10)
        for c in self.conns:
            c.close()


def _describe_until(conn: Connection, deadline: float) -> WorkerInfo:
    """Describe, retried until ``deadline`` (a server that is starting refuses connections)."""
    while True:
        try:
            return conn.describe(timeout=max(0.2, min(2.0, deadline - time.monotonic())))
        except ExpertServerError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def _plan_transport(conn: Connection, info: WorkerInfo, local: negotiate.Side) -> None:
    conn.plan_transport(info, local)


def _link_kind(conn: object) -> str:
    """The decode-step link a connection has now: "device", "host", "tcp", or ""."""
    link = getattr(conn, "link", None)
    lnk = link() if callable(link) else None
    if lnk is None:
        return ""
    if not lnk.host:
        return "device"
    return "tcp" if getattr(conn, "transport", "") == "tcp" else "host"
