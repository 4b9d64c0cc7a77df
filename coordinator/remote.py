"""The remote dispatcher: one MoE layer's routed experts computed on expert servers over gRPC.

Per MoE layer: pick a physical slot for each (token, k) through the placement -> split into
compacted per-server batches (other servers' slots masked -1) -> send to CPU servers first,
then GPU servers, without waiting -> (the model computes its shared expert meanwhile) -> await
the partial sums -> scatter-add.

Each server gets one long-lived bidirectional ``Forward`` stream; requests are pipelined and
matched to responses by sequence number. A failed or timed-out server fails the step with an
:class:`ExpertServerError` carrying a gRPC status; the next step reconnects (re-pushing the
placement if the server restarted).

Data path per server (``--transport``, negotiated at connect from ``Describe``): plain gRPC
messages, or a shared-memory / CUDA IPC fast path (expertmesh.transport) set up by a handshake
on the stream; the stream then carries only what does not fit in the ring, and the liveness.

Shapes: T tokens, K top-k, H hidden, E experts, T_s rows sent to one server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import torch

from coordinator.cluster_config import ClusterConfig, ServerSpec
from coordinator.dispatch import Dispatcher, Pending
from coordinator.expert_conn import ExpertServerError, ServerConnection, _FastReply, _GrpcReply, _status_error
from expertmesh import placement as pl
from expertmesh.config import ModelConfig
from expertmesh.transport import negotiate
from expertmesh.transport.cuda_ipc import device_uuid
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.worker.server import host_id

__all__ = ["ClusterConfig", "ExpertServerError", "RemoteDispatcher", "ServerConnection", "ServerSpec"]


class RemoteDispatcher(Dispatcher):
    def __init__(
        self,
        model_config: ModelConfig,
        cluster: ClusterConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if not cluster.servers:
            raise ValueError("a remote dispatcher needs at least one expert server")
        self.cfg, self.cluster, self.dtype, self.device = model_config, cluster, dtype, torch.device(device)
        self.conns = [ServerConnection(s, cluster, self.device) for s in cluster.servers]
        self.local_side = negotiate.Side(host_id(), device_uuid(self.device), ("shm", "cuda_ipc"))
        self.placement = self._initial_placement()
        self.full_server: int | None = None  # server holding every expert (prefill threshold)
        self.full_slots: dict[int, torch.Tensor] = {}  # layer -> [E] local slot on full_server
        self.tables = self._server_tables()
        self._rr_offset = 0
        self._all_on_gpu = False
        self._lock = threading.Lock()
        self.on_round_trip: Callable[[str, float], None] | None = None  # issue 16: (server, seconds)

    # ------------------------------------------------------------ placement

    def _initial_placement(self) -> pl.Placement:
        c, cfg = self.cluster, self.cfg
        names = tuple(s.name for s in c.servers)
        if c.placement_file:
            return pl.load_file(c.placement_file, cfg.moe_layer_ids, cfg.num_experts, names)
        n = c.num_gpu_experts
        if n is None:
            n = cfg.num_experts if not c.cpu else 0 if not c.gpu else cfg.num_experts // 2
        return pl.static_split(
            cfg.moe_layer_ids, cfg.num_experts, [s.name for s in c.gpu], [s.name for s in c.cpu], n
        )

    def _server_tables(self) -> list[dict[int, list[int]]]:
        """Slot table per server; with the prefill threshold the first GPU server also holds
        every expert it is not already given (appended after its placement slots)."""
        tables = [self.placement.server_slots(i) for i in range(len(self.conns))]
        if self.cluster.gpu_prefill_token_threshold:
            g = next(i for i, s in enumerate(self.cluster.servers) if s.kind == "gpu")
            self.full_server = g
            for layer, experts in tables[g].items():
                extra = [e for e in range(self.cfg.num_experts) if e not in experts]
                tables[g][layer] = experts + extra
                where = {e: s for s, e in reversed(list(enumerate(tables[g][layer])))}
                self.full_slots[layer] = torch.tensor(
                    [where[e] for e in range(self.cfg.num_experts)], dtype=torch.long
                )
        return tables

    # ------------------------------------------------------------ connection

    def connect(self, timeout_s: float = 60.0) -> None:
        """Describe every server, wait until it is SERVING, push the placement (two phases)."""
        deadline = time.monotonic() + timeout_s
        infos = [self._call(c, lambda c: self._describe(c, deadline)) for c in self.conns]
        # NOTE: a new coordinator's placement must be newer than whatever the servers hold
        # (they may have served an earlier coordinator), so numbering continues from theirs.
        gen = max([self.placement.generation - 1, *(i.generation for i in infos)]) + 1
        self.placement = self.placement.with_generation(gen)
        for conn in self.conns:
            self._bring_up(conn, deadline, commit=False)
        for conn in self.conns:
            self._call(conn, lambda c: c.commit(self.placement.generation, timeout_s))
            conn.state, conn.last_error = "ready", ""
        for conn in self.conns:
            self._call(conn, lambda c: c.open_stream())

    def _call(self, conn: ServerConnection, fn):
        try:
            return fn(conn)
        except grpc.RpcError as e:
            err = _status_error(conn.spec, e)
            conn.state, conn.last_error = "unavailable", str(err)
            raise err from None

    @staticmethod
    def _describe(conn: ServerConnection, deadline: float) -> pb.DescribeResponse:
        while True:
            try:
                return conn.describe(timeout=max(0.2, min(2.0, deadline - time.monotonic())))
            except grpc.RpcError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _bring_up(self, conn: ServerConnection, deadline: float, commit: bool) -> None:
        info = self._call(conn, lambda c: self._describe(c, deadline))
        self._check_compatible(conn, info)
        self._plan_transport(conn, info)
        conn.wait_serving(deadline)
        idx = self.conns.index(conn)
        table = self.tables[idx]
        need = max((len(x) for x in table.values()), default=0)
        if need > info.slot_capacity:
            raise ExpertServerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{conn.spec.name} holds at most {info.slot_capacity} slots per layer, the placement gives it {need}",
            )
        if info.generation != self.placement.generation:
            left = max(1.0, deadline - time.monotonic())
            self._call(conn, lambda c: c.push(self.placement.generation, table, left))
            if commit:
                self._call(conn, lambda c: c.commit(self.placement.generation, left))
        if commit:
            conn.state, conn.last_error = "ready", ""
            self._call(conn, lambda c: c.open_stream())

    def _plan_transport(self, conn: ServerConnection, info: pb.DescribeResponse) -> None:
        offer = negotiate.Side(info.host_id, info.device_uuid, tuple(info.fast_paths))
        try:
            choice = negotiate.choose(self.cluster.transport, self.local_side, offer, conn.spec.name)
        except negotiate.NegotiationError as e:
            conn.state, conn.last_error = "unavailable", str(e)
            raise ExpertServerError(
                grpc.StatusCode.FAILED_PRECONDITION, f"{conn.describe_self()}: {e}"
            ) from None
        if choice.transport != conn.plan:
            conn.reset("the data path changes")
        conn.plan, conn.transport_note = choice.transport, choice.reason

    def _check_compatible(self, conn: ServerConnection, info: pb.DescribeResponse) -> None:
        cfg = self.cfg
        want = (cfg.model_type, cfg.hidden_size, cfg.num_experts, cfg.moe_layer_ids)
        got = (info.model_type, info.hidden_size, info.num_experts, list(info.moe_layers))
        if want != got:
            raise ExpertServerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{conn.spec.name} serves a different model: (model_type, hidden, experts, moe layers) {got}, expected {want}",
            )

    def _ensure(self, conn: ServerConnection) -> None:
        """Before a step: a server whose stream broke is re-described (and re-placed if it
        restarted) so the step either runs on a consistent placement or fails fast."""
        if conn.stream_alive() and conn.state == "ready":
            return
        self._bring_up(conn, time.monotonic() + min(5.0, self.cluster.timeout_s), commit=True)

    def ready(self) -> bool:
        return all(c.state == "ready" for c in self.conns)

    def server_infos(self) -> list[dict]:
        out = []
        for c in self.conns:
            info = c.info
            out.append(
                dict(
                    name=c.spec.name,
                    address=c.spec.address,
                    kind=c.spec.kind,
                    state=c.state,
                    device=info.device if info else "",
                    slot_capacity=info.slot_capacity if info else 0,
                    slots_used=c.slots_used,
                    transport=c.transport,
                    transport_note=c.transport_note,
                    fast_fallbacks=c.fast_fallbacks,
                    last_error=c.last_error,
                )
            )
        return out

    # ------------------------------------------------------------ hot path

    def begin_step(self, num_tokens: int) -> None:
        t = self.cluster.gpu_prefill_token_threshold
        self._all_on_gpu = bool(t) and num_tokens >= t
        with self._lock:
            for conn in self.conns:
                self._ensure(conn)

    def _batches(
        self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> list[pl.ServerBatch]:
        if self._all_on_gpu:
            assert self.full_server is not None
            rows = torch.arange(topk_ids.shape[0])
            slots = self.full_slots[layer][topk_ids].to(torch.int32)
            return [pl.ServerBatch(self.full_server, rows, slots, topk_weights.float())]
        tables = self.placement.tables[layer]
        phys = pl.choose_replicas(topk_ids, tables, self.cluster.replica_policy, self._rr_offset)
        self._rr_offset += topk_ids.numel()
        return pl.split_by_server(phys, topk_weights, tables, len(self.conns))

    def submit(self, layer, x, topk_ids, topk_weights):
        ids, w = topk_ids.cpu(), topk_weights.cpu()
        batches = self._batches(layer, ids, w)
        # NOTE: CPU servers first: they are the slowest, so their work starts earliest.
        batches.sort(key=lambda b: self.conns[b.server].spec.kind != "cpu")
        t0 = time.perf_counter()
        sent = [(b, self.conns[b.server].submit(self.placement.generation, layer, x, b)) for b in batches]

        def wait() -> torch.Tensor:
            out = torch.zeros_like(x)  # [T, H]
            deadline = time.monotonic() + self.cluster.timeout_s
            done = 0
            try:
                for b, reply in sent:
                    part = self._collect(b, reply, layer, x.shape[1], deadline)  # [T_s, H]
                    if self.on_round_trip is not None:
                        self.on_round_trip(self.conns[b.server].spec.name, time.perf_counter() - t0)
                    part = part.to(device=x.device, dtype=x.dtype)
                    if b.rows.numel() == x.shape[0]:  # every row, in order: no index to upload
                        out.add_(part)
                    else:
                        out.index_add_(0, b.rows.to(x.device), part)
                    reply.release()
                    done += 1
            finally:
                # NOTE: answers still due are freed when they arrive, never before: the server
                # may be writing them into the ring right now.
                for _, reply in sent[done:]:
                    reply.abandon()
            return out

        return Pending(wait)

    def _collect(
        self, b: pl.ServerBatch, reply: _GrpcReply | _FastReply, layer: int, hidden: int, deadline: float
    ) -> torch.Tensor:
        conn = self.conns[b.server]
        try:
            part = reply.result(timeout=max(0.0, deadline - time.monotonic()))  # [T_s, H]
        except FutureTimeout:
            conn.reset(f"no answer within {self.cluster.timeout_s:g}s")
            conn.state, conn.last_error = "unavailable", "timed out"
            raise ExpertServerError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"expert server {conn.spec.name} ({conn.spec.address}) did not answer layer {layer} "
                f"within {self.cluster.timeout_s:g}s",
            ) from None
        if tuple(part.shape) != (b.rows.numel(), hidden):
            raise ExpertServerError(
                grpc.StatusCode.INTERNAL,
                f"{conn.spec.name} returned shape {list(part.shape)} for {b.rows.numel()} rows",
            )
        return part

    def close(self) -> None:
        for c in self.conns:
            c.close()
