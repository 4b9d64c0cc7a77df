"""The remote dispatcher: the hot path of one MoE layer's routed experts on expert servers.

Per MoE layer: replica choice (a physical slot for each (token, k) through the step's
placement, expertmesh/placement.py) -> split into compacted per-server batches (other servers'
slots masked -1) -> one :class:`~expertmesh.worker_api.ExpertRequest` per server, sent (CPU
servers first, they are slowest) without waiting -> (the model computes its shared expert
meanwhile) -> await the partial sums -> scatter-add.

Everything else belongs to the cluster (coordinator/experts/cluster.py): connections, their states,
bring-up, reconnection and placement changes. A step reads one placement generation, taken in
:meth:`RemoteDispatcher.begin_step`. A failed or timed-out server fails the step with an
:class:`ExpertServerError`; the cluster brings the server back off the step path.

Shapes: T tokens, K top-k, H hidden, E experts, T_s rows sent to one server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch

from coordinator.experts.cluster import RECONNECT_WAIT_S, ExpertCluster
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from coordinator.experts.expert_conn import ExpertReply, ExpertServerError, FastReply, ServerConnection
from coordinator.model.cuda_graphs import BUCKETS
from coordinator.model.deferral import DeferredSums, defer_mask
from coordinator.model.dispatch import Dispatcher, Pending
from expertmesh import errors
from expertmesh import placement as pl
from expertmesh.config import ModelConfig
from expertmesh.transport.client import LinkAreas
from expertmesh.transport.errors import MalformedAnswer
from expertmesh.worker_api import ExpertRequest

__all__ = ["ClusterConfig", "ExpertServerError", "RemoteDispatcher", "ServerConnection", "ServerSpec"]

_FastReply = FastReply  # the name tests/test_transport_gpu.py patches (same class object)
LINK_ROWS = BUCKETS[-1]  # R of a device link, the largest decode bucket


class RemoteDispatcher(Dispatcher):
    graph_mode = "piecewise"  # coordinator/model/remote_graphs.py

    def __init__(
        self,
        model_config: ModelConfig,
        cluster: ClusterConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        expert_cluster: ExpertCluster | None = None,
    ) -> None:
        if not cluster.servers:
            raise ValueError("a remote dispatcher needs at least one expert server")
        self.cfg, self.cluster, self.dtype, self.device = model_config, cluster, dtype, torch.device(device)
        self.expert_cluster = expert_cluster or ExpertCluster(model_config, cluster, self.device)
        self._step: pl.ServerTables | None = None  # the placement this step routes with
        self._live: dict[int, pl.LayerTables] = {}  # layer -> tables without the down servers
        self._live_key: tuple[int, frozenset[int]] | None = None
        self._down: frozenset[int] = frozenset()  # servers this step routes around
        self._lost: dict[int, torch.Tensor] = {}  # layer -> [E_lost] experts without a live server
        self._rr_offset = 0
        self._all_on_gpu = False
        # layer -> (server, [E] int32 local slot of each logical expert) for the layers whose
        # live experts all sit once on one server (rebuilt with _live): routing is one gather
        self._single: dict[int, tuple[int, np.ndarray]] = {}
        # layer -> ([E] physical slot, [E] owner server, [E] int32 local slot) for the layers whose
        # live experts sit once each on several servers (a static split, e.g. --num-gpu-experts):
        # the split is a few numpy gathers
        self._spread: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]] = {}
        self._rows = torch.arange(0)  # [T] every row of the step, in order
        # --cpu-defer-experts (coordinator/model/deferral.py); [servers] bool: a CPU server
        n = cluster.cpu_defer_experts
        self._deferred = DeferredSums(n) if n else None
        ids = model_config.moe_layer_ids
        if self._deferred is not None and ids and ids != list(range(ids[0], ids[-1] + 1)):
            # NOTE: the piecewise graphs add a held-back sum to the next MoE layer's
            # output (coordinator/model/remote_graphs.py), which is the next decoder layer's only
            # when no dense layer sits between two MoE layers: otherwise eager
            self.graph_mode = "none"
        self._cpu_server = torch.tensor([s.kind == "cpu" for s in cluster.servers])
        self.on_round_trip: Callable[[str, float], None] | None = None  # (server, seconds)

        # (server, layer, compute ms, (token, k) pairs) per answer that reports its compute
        # time (gRPC answers do; fast-path answers do not): the EPLB load recorder's speeds
        self.server_time_hook: Callable[[int, int, float, int], None] | None = None
        # set to a list to get, per layer, seconds of (route, send, the first server's own time):
        # benchmarks/bench_e2e.py's profile of the remote decode step
        # (route, send, the first server's own time, from the send's end to its answer summed)
        self.probe: list[tuple[float, float, float, float]] | None = None
        self._probe_send = (0.0, 0.0, 0.0)  # route s, send s, perf_counter at the send's end
        # --- the device link (coordinator/model/remote_graphs.py) ---
        # [L_moe, E] int32 on our GPU: the local slot of each logical expert per MoE layer (in
        # moe_layer_ids order) on the one server every layer routes to; refreshed in place when
        # the placement or the down servers change. Its address is captured in the linked graphs.
        self.link_table: torch.Tensor
        self._link_server: int | None = None  # that server (None: this placement cannot link)
        # the hybrid linked step: [L_moe, E] int32 on our GPU, the in-process member's slot of
        # each logical expert (-1: on the linked server), and that member's index; None: every
        # expert of the step is on the linked server
        self.link_local_table: torch.Tensor
        self._link_local: int | None = None
        self.linked_steps = 0  # decode steps run over the link
        self.linked_micro_steps = 0  # of those, the ones run as micro-batches (--micro-batches)
        self.link_reruns = 0  # linked steps that failed (error bits) and ran again without it
        # NOTE: made on any device (tested on the CPU); only a CUDA coordinator offers a link
        self.link_table = torch.full(
            (len(ids), model_config.num_experts), -1, dtype=torch.int32, device=self.device
        )
        self.link_local_table = torch.full_like(self.link_table, -1)
        if self.device.type == "cuda":
            for c in self.conns:
                if isinstance(c, ServerConnection):
                    c.link_shape = (LINK_ROWS, model_config.hidden_size, model_config.top_k)

    # ------------------------------------------------------------ the cluster, for callers

    def connect(self, timeout_s: float = 60.0) -> None:
        self.expert_cluster.connect(timeout_s)

    @property
    def conns(self) -> list[ServerConnection]:
        return self.expert_cluster.conns  # type: ignore[return-value]

    @property
    def placement(self) -> pl.Placement:
        return self.expert_cluster.placement

    def ready(self) -> bool:
        return self.expert_cluster.ready()

    def server_infos(self) -> list[dict]:
        return self.expert_cluster.server_infos()

    def close(self) -> None:
        self.expert_cluster.close()

    # ------------------------------------------------------------ hot path

    def begin_step(self, num_tokens: int) -> None:
        down = self.expert_cluster.step_down(min(RECONNECT_WAIT_S, self.cluster.timeout_s))
        # NOTE: a step never mixes placement generations: it keeps the tables it starts with
        tables = self._step = self.expert_cluster.tables
        if self._deferred is not None:  # frees what a failed step left un-awaited
            self._deferred.reset()
        if (tables.generation, down) != self._live_key:  # servers to route around changed
            self._route_around(tables, down)
        if self._rows.numel() != num_tokens:  # NOTE: once per step: every layer's batch reuses it
            self._rows = torch.arange(num_tokens)
        t = self.cluster.gpu_prefill_token_threshold
        self._all_on_gpu = bool(t) and num_tokens >= t and tables.full_server not in down

    def _route(
        self, tables: pl.ServerTables, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[list[pl.ServerBatch], torch.Tensor | None]:
        """The per-server batches, and the physical slot of each (token, k) ``[T, K]`` (None on
        the full-server path: every pair went there)."""
        if self._all_on_gpu:
            return [pl.all_on_server(tables, layer, topk_ids, topk_weights)], None
        # the layer's replicas on live servers (all of them unless a server is routed around)
        if self._lost and tables is self._step and layer in self._lost:  # failover
            self._check_lost(layer, topk_ids)  # NOTE: may refresh self._live: read it after
        lt = self._live.get(layer) if tables is self._step else None
        lt = lt if lt is not None else tables.placement.tables[layer]
        # NOTE: not with --cpu-defer-experts, whose split needs the physical slots
        single = self._single.get(layer) if tables is self._step and self._deferred is None else None
        spread = self._spread.get(layer) if tables is self._step else None
        if spread is not None:  # NOTE: every replica policy picks the only replica
            return _spread_route(spread, topk_ids, topk_weights)
        if single is not None:  # NOTE: every replica policy picks the only replica
            server, local = single
            t = topk_ids.shape[0]
            rows = self._rows if self._rows.numel() == t else torch.arange(t)
            # numpy: on a few dozen ids its gather costs a fraction of torch's per-op overhead
            slots = torch.from_numpy(local[topk_ids.numpy()])  # [T, K] int32
            batch = pl.ServerBatch(server, rows, slots, topk_weights.float())
            return [batch], None  # None: a lost server had every pair, as on the full-server path
        phys = pl.choose_replicas(topk_ids, lt, self.cluster.replica_policy, self._rr_offset)  # [T, K]
        self._rr_offset += topk_ids.numel()
        return pl.split_by_server(phys, topk_weights, lt, len(tables.slots)), phys

    def _send(
        self, tables: pl.ServerTables, layer: int, x: torch.Tensor, batches: list[pl.ServerBatch], adapters
    ) -> list[tuple[pl.ServerBatch, ExpertReply]]:
        conns = self.conns
        sent = []
        for b in batches:
            conn = conns[b.server]
            a = None if adapters is None else adapters[b.rows]  # [T_s]
            req = ExpertRequest(
                conn.next_seq(), tables.generation, layer, x, b.slot_ids, b.weights, a, b.rows
            )
            sent.append((b, conn.submit(req)))
        return sent

    def stage(self, layer: int, x: torch.Tensor) -> None:
        """The piecewise graphs' hint, right after a segment's replay: ``x [T, H]`` goes whole
        to one server this layer (no failover, no deferral, no full-server step), so its copy to
        that server's fast path starts now, overlapping the segment (coordinator/model/remote_graphs.py)."""
        if self._deferred is not None or self._all_on_gpu or self._lost or self._step is None:
            return
        single = self._single.get(layer)
        if single is not None:
            self.conns[single[0]].stage(x, self.cfg.top_k)

    def submit(
        self,
        layer,
        x,
        topk_ids,
        topk_weights,
        adapter_slots: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ):
        """``adapter_slots [T]`` int32 (MoE LoRA, -1 = none) travels with each server's rows.
        ``out [T, H]``: where ``wait()`` writes the sum (a static buffer of the piecewise graphs,
        coordinator/model/remote_graphs.py); a fresh tensor when None. ``topk_ids``/``topk_weights``
        may already be on the host (pinned): then nothing is copied here."""
        t_start = time.perf_counter()
        tables = self._step or self.expert_cluster.tables
        ids = topk_ids if topk_ids.device.type == "cpu" else topk_ids.cpu()  # [T, K]
        w = topk_weights if topk_weights.device.type == "cpu" else topk_weights.cpu()  # [T, K]
        batches, phys = self._route(tables, layer, ids, w)
        # NOTE: CPU servers first: they are the slowest, so their work starts earliest.
        conns = self.conns
        # --- --cpu-defer-experts holds back pairs (coordinator/model/deferral.py) ---
        held = self._defer_mask(tables, layer, w, phys)  # [T, K] bool or None
        if held is not None:
            assert phys is not None
            batches = pl.split_by_server(phys, w, tables.placement.tables[layer], len(tables.slots), ~held)
        if len(batches) > 1:
            batches.sort(key=lambda b: conns[b.server].spec.kind != "cpu")
        adapters = None if adapter_slots is None else adapter_slots.cpu().to(torch.int32)  # [T]
        t0 = time.perf_counter()
        sent = self._send(tables, layer, x, batches, adapters)
        if self.probe is not None:
            now_s = time.perf_counter()
            self._probe_send = (t0 - t_start, now_s - t0, now_s)
        now = None if held is None else ~held  # a re-send must not repeat held pairs
        wait, _ = self._waiter(tables, layer, x, ids, w, phys, adapters, sent, t0, now, out)
        # --- the held-back pairs go last (a server answers in arrival order) ---
        if held is not None and self._deferred is not None:
            assert phys is not None
            later = pl.split_by_server(phys, w, tables.placement.tables[layer], len(tables.slots), held)
            sent2 = self._send(tables, layer, x, later, adapters)
            self._deferred.put(*self._waiter(tables, layer, x, ids, w, phys, adapters, sent2, t0, held))
        return Pending(wait)

    def _waiter(
        self,
        tables: pl.ServerTables,
        layer: int,
        x: torch.Tensor,  # [T, H]
        ids: torch.Tensor,  # [T, K] logical
        w: torch.Tensor,  # [T, K]
        phys: torch.Tensor | None,  # [T, K]
        adapters: torch.Tensor | None,
        sent: list[tuple[pl.ServerBatch, ExpertReply]],
        t0: float,
        only: torch.Tensor | None,  # [T, K] bool: the pairs these batches carry (None: all)
        out: torch.Tensor | None = None,  # [T, H] where the sum goes (None: a new tensor)
    ) -> tuple[Callable[[], torch.Tensor], Callable[[], None]]:
        """(wait: the sum of ``sent``'s answers ``[T, H]``, abandon: frees answers never awaited)."""
        conns = self.conns

        def wait() -> torch.Tensor:
            # --- the GPU servers' answers are awaited first, each summed as it comes ---
            # NOTE: in a hybrid layer the GPU share answers first: summing it at once switches
            # the GPU back to this process's context (a same-GPU server ran last; ~0.1-0.2 ms on
            # the lent H100) while the CPU server still computes. A CPU answer that comes first
            # waits in its ring until the GPU answers are in, so no copy or add of ours lands
            # inside a same-GPU server's share (a context switch there). Sends stay CPU first.
            dst = torch.empty_like(x) if out is None else out  # [T, H]
            first = time.monotonic() + self.cluster.timeout_s
            todo = sorted(
                ((b, r, first) for b, r in sent), key=lambda s: conns[s[0].server].spec.kind == "cpu"
            )
            started = False  # dst holds a partial sum
            i = 0
            try:
                while i < len(todo):
                    b, reply, deadline = todo[i]
                    i += 1
                    try:
                        part = self._collect(b, reply, layer, x.shape[1], deadline)  # [T_s, H]
                    except ExpertServerError as e:
                        reply.abandon()
                        if not isinstance(e.error, (errors.Unavailable, errors.DeadlineExceeded)):
                            raise  # a refused request is not a server failure
                        # NOTE: the lost server's share of this layer goes to live replicas;
                        # nothing it computed is summed (it answered nothing)
                        again = time.monotonic() + self.cluster.timeout_s
                        resent = self._resend(tables, layer, x, ids, w, phys, b.server, e, adapters, only)
                        todo += [(b2, r2, again) for b2, r2 in resent]
                        continue
                    try:
                        _accumulate(dst, b, part, started)
                        started = True
                    finally:
                        reply.release()
                    if self.on_round_trip is not None:
                        self.on_round_trip(conns[b.server].spec.name, time.perf_counter() - t0)
                    ms = getattr(reply, "compute_ms", None)
                    if ms is not None and self.server_time_hook is not None:
                        self.server_time_hook(b.server, layer, ms, int((b.slot_ids >= 0).sum()))
            finally:
                # NOTE: answers still due are freed when they arrive, never before: the server
                # may be writing them into the ring right now.
                for _, reply, _ in todo[i:]:
                    reply.abandon()
            if not started:  # no pair of the layer went anywhere
                dst.zero_()
            if (
                self.probe is not None and sent
            ):  # the server's own time: the fast path's descriptor, gRPC's field
                fast = getattr(sent[0][1], "reply", None)
                ms = fast.server_ms if fast is not None else getattr(sent[0][1], "compute_ms", None)
                route_s, send_s, sent_at = self._probe_send
                self.probe.append((route_s, send_s, (ms or 0.0) * 1e-3, time.perf_counter() - sent_at))
            return dst

        def abandon() -> None:
            for _, reply in sent:
                reply.abandon()

        return wait, abandon

    def _defer_mask(
        self, tables: pl.ServerTables, layer: int, w: torch.Tensor, phys: torch.Tensor | None
    ) -> torch.Tensor | None:  # [T, K] bool
        """The pairs ``--cpu-defer-experts`` holds back this layer (None: none)."""
        if self._deferred is None or phys is None:
            return None
        if self._cpu_server.numel() < len(tables.slots):  # a server joined the pool at run time
            self._cpu_server = torch.tensor([c.spec.kind == "cpu" for c in self.conns])
        on_cpu = self._cpu_server[tables.placement.tables[layer].owner[phys]]  # [T, K]
        return defer_mask(w, on_cpu, self._deferred.n)

    def take_deferred(self) -> Pending | None:
        return None if self._deferred is None else self._deferred.take()

    # ------------------------------------------------------------ failover

    def _route_around(self, tables: pl.ServerTables, down: frozenset[int]) -> None:
        self._live_key, self._down = (tables.generation, down), down
        self._live = {layer: pl.live_tables(lt, down) for layer, lt in tables.placement.tables.items()}
        self._single, self._spread = {}, {}
        for layer, lt in self._live.items():
            owners = lt.owner[lt.log2phy[:, 0]]  # [E] (-1 rows: lost experts, excluded by logcnt)
            if not bool((lt.logcnt == 1).all()):
                continue
            local = lt.local_slot[lt.log2phy[:, 0]].to(torch.int32).numpy()  # [E]
            if bool((owners == owners[0]).all()):
                self._single[layer] = (int(owners[0]), local)
            else:
                servers = sorted(set(owners.tolist()))
                self._spread[layer] = (lt.log2phy[:, 0].contiguous().numpy(), owners.numpy(), local, servers)
        self._lost = {  # per layer, the experts no live server holds [E_lost]
            layer: torch.tensor(ex, dtype=torch.long)
            for layer, ex in pl.uncovered(tables.placement.tables, down).items()
        }
        self._refresh_link_table()

    # ------------------------------------------------------------ the device link

    def _refresh_link_table(self) -> None:
        """The linked path's slot tables, when every MoE layer's live experts sit on one and the
        same server, or are split between that server and the in-process member (``local``:
        the hybrid step computes its share inside the same graph). A replicated expert is
        computed by one copy, always the same: the local one where there is one (the GPU),
        else the server's first. Any other server holding an expert: no step links."""
        ids = self.cfg.moe_layer_ids
        self._link_server = self._link_local = None
        local = next((i for i, c in enumerate(self.conns) if getattr(c.spec, "in_process", False)), None)
        if not ids or any(layer not in self._live for layer in ids):
            return
        owners, slots = [], []  # per MoE layer, [E]: the copy each expert is linked to, its slot
        for layer in ids:
            lt = self._live[layer]
            if bool((lt.logcnt < 1).any()):  # a lost expert: the piecewise path waits or fails
                return
            phys = lt.log2phy.clamp(min=0)  # [E, R]
            owner = torch.where(lt.log2phy >= 0, lt.owner[phys], -2)  # [E, R], -2: no copy
            first = lt.log2phy[:, 0]  # [E]
            if local is not None:  # the local copy where there is one
                at = (owner == local).to(torch.int8).argmax(1)  # [E]
                has = (owner == local).any(1)
                first = torch.where(has, lt.log2phy.gather(1, at[:, None])[:, 0], first)
            owners.append(lt.owner[first].numpy())
            slots.append(lt.local_slot[first].numpy())
        every = np.stack(owners)  # [L_moe, E]
        remote = set(np.unique(every).tolist()) - {local}
        if len(remote) != 1:  # every expert in process, or several servers
            return
        server = remote.pop()
        slot = np.stack(slots).astype(np.int32)  # [L_moe, E]
        on_server = torch.from_numpy(np.where(every == server, slot, -1).astype(np.int32))
        on_local = torch.from_numpy(np.where(every == local, slot, -1).astype(np.int32))
        # NOTE: between steps (begin_step): no linked graph reads them now
        self.link_table.copy_(on_server)
        self.link_local_table.copy_(on_local)
        self._link_server = server
        self._link_local = local if local is not None and bool((every == local).any()) else None

    def link_plan(self, rows: int) -> tuple[int, ServerConnection, LinkAreas] | None:
        """(server, connection, link) when this decode step of ``rows`` sequences may run over
        the device (or host) link: every MoE layer on that one server, or split between it and
        the in-process member (:meth:`link_local`), each expert once, a live link, ``rows``
        within its areas, no --cpu-defer-experts, no lost experts, not a full-server step.
        None: the piecewise path."""
        if self._link_server is None or self._step is None:
            return None
        if self._deferred is not None or self._all_on_gpu or self._lost:
            return None
        conn = self.conns[self._link_server]
        lnk = conn.link() if isinstance(conn, ServerConnection) else None
        if lnk is None or rows > lnk.rows:
            return None
        return self._link_server, conn, lnk

    def link_local(self) -> Any:
        """The in-process member (coordinator/experts/local.py) that computes its share of a
        hybrid linked step, or None (the linked server holds every expert)."""
        return None if self._link_local is None else self.conns[self._link_local]

    def launch_link_step(
        self, server: int, conn: ServerConnection, step: int, rows: int, bucket: int, micro: int = 1
    ) -> str | Callable[[], str]:
        """Sends the step's LinkStep (``micro`` micro-batches): why it could not (a string), or
        the call that reads the server's answer, "" when the server launched its step, else
        why not (the step then runs the piecewise path). A hung server is marked down in
        either."""
        assert self._step is not None
        try:
            sent = conn.send_link_step(
                step, rows, bucket, self._step.generation, self.cluster.timeout_s, micro
            )
        except ExpertServerError as e:
            self.expert_cluster.mark_down(server, e)
            return str(e)
        if isinstance(sent, str):
            return sent

        def answer() -> str:
            try:
                return sent()
            except ExpertServerError as e:
                self.expert_cluster.mark_down(server, e)
                return str(e)

        return answer

    def link_failed(self, server: int, conn: ServerConnection, bits: int) -> None:
        """A linked step came back with error bits: nothing of it is used; the server is marked
        down and its stream reset (the caller runs the same step again without the link)."""
        from expertmesh.transport import link  # NOTE: Triton: a CUDA coordinator's path only
        from expertmesh.transport import link_layout as ll

        what = []
        if bits & link.ERR_TIMEOUT:
            what.append(f"no answer within {self.cluster.timeout_s:g}s")
        if bits & link.ERR_BAD_SLOT:
            what.append("it saw slot ids outside its slots")
        if bits & ll.ERR_KERNEL:
            what.append("its host link's kernel refused a layer")
        if bits & ll.ERR_WIRE:
            what.append("the relay's TCP connection failed or carried a bad frame")
        err = ExpertServerError.of(
            errors.Unavailable(f"{conn.describe_self()}: device-link step failed: {'; '.join(what) or bits}")
        )
        self.link_reruns += 1
        conn.reset(str(err))
        self.expert_cluster.mark_down(server, err)

    def _check_lost(self, layer: int, topk_ids: torch.Tensor) -> None:
        """A step whose tokens need an expert of ``layer`` that no live server holds waits
        (bounded, as a step did before failover) for the cluster to bring a holder back, then
        fails (UNAVAILABLE naming the experts and the servers); a step that needs none of the
        lost experts never gets here."""
        hit = torch.isin(topk_ids, self._lost[layer])  # [T, K]
        if not bool(hit.any()):
            return
        need = topk_ids[hit].unique().tolist()
        rows = tuple(hit.any(1).nonzero().flatten().tolist())
        tables = self._step
        assert tables is not None
        try:
            wait = self.expert_cluster.outage_wait(min(RECONNECT_WAIT_S, self.cluster.timeout_s))
            down = self.expert_cluster.ensure_ready(wait)
        except ExpertServerError as e:
            if not isinstance(e.error, errors.Unavailable):
                raise  # e.g. an incompatible server: its own message says more
            lost = self.expert_cluster.lost_experts(layer, need, self.expert_cluster.down())
            lost.rows = rows
            raise lost from None
        # NOTE: the step keeps its generation (commits land between steps, on this thread)
        self._route_around(tables, down)

    def _resend(
        self,
        tables: pl.ServerTables,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,  # [T, K] logical
        w: torch.Tensor,  # [T, K]
        phys: torch.Tensor | None,  # [T, K] physical slots of the first send (None: full server)
        lost: int,
        err: ExpertServerError,
        adapters: torch.Tensor | None,
        only: torch.Tensor | None = None,  # [T, K] bool: the pairs the lost batch was part of
    ) -> list[tuple[pl.ServerBatch, ExpertReply]]:
        """Re-sends the (token, k) pairs that went to server ``lost`` to live replicas of the
        same experts; raises (naming the experts and the server) when some have none."""
        lt = tables.placement.tables[layer]
        down = self.expert_cluster.down() | {lost}
        live = pl.live_tables(lt, down)
        pairs = torch.ones_like(ids, dtype=torch.bool) if phys is None else lt.owner[phys] == lost  # [T, K]
        if only is not None:  # deferred and immediate pairs are re-sent apart
            pairs &= only
        need = ids[pairs].unique().tolist()
        missing = [e for e in need if int(live.logcnt[e]) == 0]
        if missing:
            gone = ExpertServerError.of(
                type(err.error)(f"{err}; layer {layer} experts {missing} have no live replica")
            )
            gone.rows = tuple(
                (pairs & torch.isin(ids, torch.tensor(missing))).any(1).nonzero().flatten().tolist()
            )
            raise gone from None
        ids2 = torch.where(pairs, ids, need[0])  # [T, K] other pairs: any live expert (masked below)
        phys2 = pl.choose_replicas(ids2, live, self.cluster.replica_policy, self._rr_offset)  # [T, K]
        self._rr_offset += ids.numel()
        return self._send(
            tables, layer, x, pl.split_by_server(phys2, w, live, len(tables.slots), pairs), adapters
        )

    def _collect(
        self, b: pl.ServerBatch, reply: ExpertReply, layer: int, hidden: int, deadline: float
    ) -> torch.Tensor:
        conn = self.conns[b.server]
        try:
            part = reply.result(timeout=max(0.0, deadline - time.monotonic()))  # [T_s, H]
        except FutureTimeout:
            conn.reset(f"no answer within {self.cluster.timeout_s:g}s")
            self.expert_cluster.mark_down(b.server, "timed out")
            raise ExpertServerError.of(
                errors.DeadlineExceeded(
                    f"expert server {conn.spec.name} ({conn.spec.address}) did not answer layer {layer} "
                    f"within {self.cluster.timeout_s:g}s"
                )
            ) from None
        except ExpertServerError as e:
            if isinstance(e.error, MalformedAnswer):  # as for a lost server
                self.expert_cluster.mark_down(b.server, e)
            raise
        # an answer of the wrong shape or kind is the server failing the layer (its
        # rows go to live replicas), never a sum of garbage nor the step's INTERNAL error
        what = _malformed(part, b.rows.numel(), hidden)
        if what:
            err = conn.bad_answer(layer, what)
            self.expert_cluster.mark_down(b.server, err)
            raise err
        return part


def _malformed(part: torch.Tensor, rows: int, hidden: int) -> str:
    """Why ``part`` cannot be the ``[rows, hidden]`` partial sum sent for ("" if it can).
    NaN/Inf are not checked: an overflow in the model yields them in process too, and a
    reduction over every answer would cost the hot path (and mark healthy replicas down)."""
    if tuple(part.shape) != (rows, hidden):
        return f"shape {list(part.shape)} for {rows} rows of hidden size {hidden}"
    if not part.dtype.is_floating_point:
        return f"dtype {str(part.dtype).removeprefix('torch.')}, expected a floating-point tensor"
    return ""


def _accumulate(dst: torch.Tensor, b: pl.ServerBatch, part: torch.Tensor, started: bool) -> None:
    """Adds one server's answer ``part [T_s, H]`` (rows ``b.rows``) into ``dst [T, H]``;
    the first answer, if it holds every row (rows are sorted and unique), is copied instead of
    added to zeros: a one-server layer costs one copy."""
    t = dst.shape[0]
    if not started and b.rows.numel() == t:
        dst.copy_(part)  # any device
        return
    if not started:
        dst.zero_()
    part = part.to(device=dst.device, dtype=dst.dtype)
    if b.rows.numel() == t:  # every row, in order: no index to upload
        dst.add_(part)
    else:
        dst.index_add_(0, b.rows.to(dst.device), part)


def _spread_route(
    spread: tuple[np.ndarray, np.ndarray, np.ndarray, list[int]],
    topk_ids: torch.Tensor,  # [T, K] logical, on the host
    topk_weights: torch.Tensor,  # [T, K]
) -> tuple[list[pl.ServerBatch], torch.Tensor]:
    """``split_by_server`` for a layer whose experts sit once each, in numpy (on a
    few dozen ids torch's per-op overhead is most of the cost): the per-server batches (servers
    in ascending order) and the physical slots ``[T, K]``."""
    phys, owner, local, servers = spread
    ids = topk_ids.numpy()
    wts = topk_weights.float().numpy()  # no copy when already float32
    own, loc = owner[ids], local[ids]  # [T, K]
    out = []
    for s in servers:
        mine = own == s  # [T, K]
        rows = np.flatnonzero(mine.any(axis=1))  # [T_s]
        if rows.size:
            slots = np.where(mine[rows], loc[rows], np.int32(-1))  # [T_s, K] int32
            out.append(
                pl.ServerBatch(
                    s, torch.from_numpy(rows), torch.from_numpy(slots), torch.from_numpy(wts[rows])
                )
            )
    return out, torch.from_numpy(phys[ids])
