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

import argparse
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.dispatch import Dispatcher, Pending
from expertmesh import placement as pl
from expertmesh import wire
from expertmesh.config import ModelConfig
from expertmesh.transport import negotiate
from expertmesh.transport.client import Reply, ShmClient
from expertmesh.transport.cuda_ipc import CudaIpcError, device_uuid
from expertmesh.transport.errors import Rejected
from expertmesh.transport.handshake import Ack, HandshakeError
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.worker.server import grpc_options, host_id

log = logging.getLogger("expertmesh.remote")


class ExpertServerError(RuntimeError):
    """An expert server failed, timed out or is unavailable; ``code`` is a grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ServerSpec:
    name: str
    address: str
    kind: str  # "gpu" | "cpu"

    def __post_init__(self) -> None:
        assert self.kind in ("gpu", "cpu"), f"{self.kind=}"


@dataclass(frozen=True)
class ClusterConfig:
    servers: tuple[ServerSpec, ...]
    num_gpu_experts: int | None = None  # None: all on GPU servers if no CPU server, etc., else half
    placement_file: str | None = None
    replica_policy: str = "static"
    gpu_prefill_token_threshold: int = 0  # 0 = off
    timeout_s: float = 30.0
    transport: str = "auto"  # auto | grpc | shm | cuda_ipc (expertmesh/transport/negotiate.py)
    max_message_mb: int = 256
    shm_ring_mb: float = 64  # per server stream; a payload that does not fit goes over gRPC
    shm_spin_us: float = 300.0  # poll for a fast-path answer this long before sleeping

    def __post_init__(self) -> None:
        assert self.replica_policy in ("static", "round_robin"), f"{self.replica_policy=}"
        assert self.transport in negotiate.CHOICES, f"{self.transport=}"
        assert self.shm_ring_bytes >= 4096, f"{self.shm_ring_mb=}"
        assert self.timeout_s > 0, f"{self.timeout_s=}"
        names = [s.name for s in self.servers]
        assert len(set(names)) == len(names), f"duplicate server names {names}"
        if self.gpu_prefill_token_threshold and not self.gpu:
            raise ValueError("--gpu-prefill-token-threshold needs a GPU expert server")

    @property
    def shm_ring_bytes(self) -> int:
        return int(self.shm_ring_mb * (1 << 20)) // 4096 * 4096

    @property
    def gpu(self) -> list[ServerSpec]:
        return [s for s in self.servers if s.kind == "gpu"]

    @property
    def cpu(self) -> list[ServerSpec]:
        return [s for s in self.servers if s.kind == "cpu"]

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("expert servers")
        g.add_argument("--gpu-server", action="append", default=[], metavar="HOST:PORT", help="repeatable")
        g.add_argument("--cpu-server", action="append", default=[], metavar="HOST:PORT", help="repeatable")
        g.add_argument("--num-gpu-experts", type=int, default=None, help="logical ids < N on GPU servers")
        g.add_argument(
            "--placement", default=None, metavar="FILE", help="JSON placement (see expertmesh/placement.py)"
        )
        g.add_argument("--replica-policy", default="static", choices=["static", "round_robin"])
        g.add_argument(
            "--gpu-prefill-token-threshold",
            type=int,
            default=0,
            help="steps with >= T tokens run all experts on the GPU server",
        )
        g.add_argument(
            "--expert-timeout",
            type=float,
            default=30.0,
            help="seconds before an expert server is declared failed",
        )
        g.add_argument(
            "--transport",
            default="auto",
            choices=list(negotiate.CHOICES),
            help="data path to the expert servers: auto = the fastest both sides offer; shm / cuda_ipc = "
            "require shared memory / CUDA IPC (same host / same GPU); grpc = plain gRPC",
        )
        g.add_argument(
            "--shm-ring-mb",
            type=float,
            default=64,
            help="shared-memory ring per expert server; larger payloads go over gRPC",
        )
        g.add_argument(
            "--shm-spin-us",
            type=float,
            default=300.0,
            help="fast paths: poll this long for an answer before sleeping (0 = always sleep)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterConfig:
        servers = [ServerSpec(f"gpu{i}", a, "gpu") for i, a in enumerate(args.gpu_server)]
        servers += [ServerSpec(f"cpu{i}", a, "cpu") for i, a in enumerate(args.cpu_server)]
        return cls(
            servers=tuple(servers),
            num_gpu_experts=args.num_gpu_experts,
            placement_file=args.placement,
            replica_policy=args.replica_policy,
            gpu_prefill_token_threshold=args.gpu_prefill_token_threshold,
            timeout_s=args.expert_timeout,
            transport=args.transport,
            shm_ring_mb=args.shm_ring_mb,
            shm_spin_us=args.shm_spin_us,
        )


@dataclass
class _Stream:
    call: grpc.Future  # the streaming call (also an iterator of responses)
    requests: queue.Queue
    pending: dict[int, Future] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    dead: ExpertServerError | None = None
    fast: ShmClient | None = None  # the stream's shared-memory channel, if it has one


class _GrpcReply:
    def __init__(self, fut: Future) -> None:
        self.fut = fut

    def result(self, timeout: float) -> torch.Tensor:  # [T_s, H]
        return wire.decode(self.fut.result(timeout=timeout).output, "output")

    def release(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class _FastReply:
    def __init__(self, conn: ServerConnection, st: _Stream, reply: Reply) -> None:
        self.conn, self.st, self.reply = conn, st, reply

    def result(self, timeout: float) -> torch.Tensor:  # [T_s, H], a view valid until release()
        try:
            return self.reply.result(timeout)
        except Rejected as e:
            if self.st.dead is not None:  # the stream died: its error says why
                raise self.st.dead from None
            # the server refused the request: as on the gRPC path, that ends the stream
            err = ExpertServerError(e.code, f"{self.conn.describe_self()}: {e.code.name}: {e.message}")
            self.conn.end_stream(self.st, err)
            raise err from None

    def release(self) -> None:
        self.reply.release()

    def abandon(self) -> None:
        self.reply.abandon()


class ServerConnection:
    """One expert server: channel, description, placement push, the Forward stream."""

    def __init__(self, spec: ServerSpec, cluster: ClusterConfig, device: torch.device | None = None) -> None:
        self.spec, self.cluster = spec, cluster
        self.device = device or torch.device("cpu")
        self.channel = grpc.insecure_channel(
            spec.address,
            options=[
                *grpc_options(cluster.max_message_mb << 20),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self.stub = pb_grpc.ExpertWorkerStub(self.channel)
        self.info: pb.DescribeResponse | None = None
        self.dtype: torch.dtype | None = None
        self.state = "connecting"
        self.last_error = ""
        self.slots_used = 0
        self._stream: _Stream | None = None
        self._seq = itertools.count(1)
        self.plan = "grpc"  # data path chosen from Describe (negotiate.choose)
        self.transport = "grpc"  # the path of the current stream (the handshake may settle lower)
        self.transport_note = ""  # why nothing faster
        self.fast_fallbacks = 0  # requests sent over gRPC on a fast stream (no room in the ring)

    def describe_self(self) -> str:
        return f"expert server {self.spec.name} ({self.spec.address})"

    # ------------------------------------------------------------ control plane

    def describe(self, timeout: float) -> pb.DescribeResponse:
        info = self.stub.Describe(pb.DescribeRequest(), timeout=timeout)
        self.info, self.dtype = info, wire.parse_dtype(info.dtype)
        return info

    def wait_serving(self, deadline: float) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        while True:
            left = deadline - time.monotonic()
            try:
                st = stub.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=max(0.1, min(left, 2.0))
                ).status
                if st == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as e:
                if left <= 0:
                    raise _status_error(self.spec, e) from None
            if left <= 0:
                raise ExpertServerError(
                    grpc.StatusCode.UNAVAILABLE, f"{self.spec.name} ({self.spec.address}) is not SERVING yet"
                )
            time.sleep(0.1)

    def push(self, generation: int, table: dict[int, list[int]], timeout: float) -> None:
        layers = [pb.LayerSlots(layer=layer, experts=ex) for layer, ex in sorted(table.items())]
        prep = pb.ApplyPlacementRequest(
            phase=pb.ApplyPlacementRequest.PREPARE, generation=generation, layers=layers
        )
        self.stub.ApplyPlacement(prep, timeout=timeout)
        self.slots_used = max((len(x) for x in table.values()), default=0)

    def commit(self, generation: int, timeout: float) -> None:
        req = pb.ApplyPlacementRequest(phase=pb.ApplyPlacementRequest.COMMIT, generation=generation)
        self.stub.ApplyPlacement(req, timeout=timeout)

    # ------------------------------------------------------------ data plane

    def _open(self) -> _Stream:
        q: queue.Queue = queue.Queue()
        call = self.stub.Forward(iter(q.get, None))
        st = _Stream(call, q)
        threading.Thread(target=self._read, args=(st,), daemon=True, name=f"read-{self.spec.name}").start()
        self.transport = "grpc"
        if self.plan != "grpc":
            self._handshake(st)
        return st

    def _handshake(self, st: _Stream) -> None:
        """Offers the planned fast path on a new stream and settles for the server's answer."""
        try:
            fast = ShmClient(self.plan, self.cluster.shm_ring_bytes, self.device, self.cluster.shm_spin_us)
        except (OSError, CudaIpcError) as e:
            self._settle(st, None, Ack("grpc", f"cannot create the shared-memory channel here: {e}"))
            return
        fut: Future = Future()
        with st.lock:
            st.pending[0] = fut
        st.requests.put(pb.ForwardRequest(seq=0, fast_path=fast.hello()))
        wait_s = min(10.0, self.cluster.timeout_s)
        try:
            ack = Ack.decode(fut.result(timeout=wait_s).fast_path)
        except (ExpertServerError, FutureTimeout, HandshakeError) as e:
            fast.close()
            why = str(e) or f"no answer within {wait_s:g}s"
            self.end_stream(
                st,
                ExpertServerError(
                    grpc.StatusCode.UNAVAILABLE, f"{self.describe_self()}: fast-path handshake: {why}"
                ),
            )
            assert st.dead is not None
            raise st.dead from None
        self._settle(st, fast, ack)

    def _settle(self, st: _Stream, fast: ShmClient | None, ack: Ack) -> None:
        """Takes the server's answer (``auto`` accepts a slower path, a required path does not)."""
        requested = self.cluster.transport
        if not negotiate.acceptable(requested, self.plan, ack.transport):
            why = f"{self.describe_self()} answered {ack.transport}: {ack.reason}"
            self._refuse(st, fast, f"--transport {requested}: {why}")
        self.transport_note = ack.reason
        if ack.transport == "grpc":
            if fast is not None:
                fast.close()
            log.info("%s: plain gRPC (%s)", self.spec.name, ack.reason)
            return
        assert fast is not None
        try:
            fast.accept(ack)
        except CudaIpcError as e:
            if requested == "auto":
                self.plan = "shm"  # the next stream asks for less
            self._refuse(st, fast, f"{self.describe_self()}: cannot map its CUDA IPC output ring: {e}")
        st.fast, self.transport = fast, fast.transport

    def _refuse(self, st: _Stream, fast: ShmClient | None, message: str) -> NoReturn:
        if fast is not None:
            fast.close()
        err = ExpertServerError(grpc.StatusCode.FAILED_PRECONDITION, message)
        self.end_stream(st, err)
        raise err

    def _read(self, st: _Stream) -> None:
        try:
            for resp in st.call:
                with st.lock:
                    fut = st.pending.pop(resp.seq, None)
                if fut is not None:
                    fut.set_result(resp)
            err = ExpertServerError(grpc.StatusCode.UNAVAILABLE, f"{self.spec.name}: stream closed")
        except grpc.RpcError as e:
            err = _status_error(self.spec, e)
        self._fail(st, err)

    def _fail(self, st: _Stream, err: ExpertServerError) -> None:
        with st.lock:
            first = st.dead is None
            if first:  # NOTE: the first error says why; the cancellation that follows does not
                st.dead = err
            pending, st.pending = st.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(st.dead)
        if st.fast is not None:
            st.fast.kill(Rejected(err.code, str(err)))
        if first and err.code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            self.state, self.last_error = "unavailable", str(err)

    def end_stream(self, st: _Stream, err: ExpertServerError) -> None:
        """Fails ``st`` with ``err``, cancels it and frees its channel (the caller's thread)."""
        self._fail(st, err)
        st.requests.put(None)
        st.call.cancel()
        if st.fast is not None:
            st.fast.close()
        if self._stream is st:
            self._stream = None

    def reset(self, reason: str) -> None:
        st = self._stream
        if st is not None:
            self.end_stream(
                st, ExpertServerError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.spec.name}: {reason}")
            )

    def open_stream(self) -> _Stream:
        """The live stream, opened (with its handshake) if there is none."""
        st = self._stream
        if st is not None and st.dead is None and st.fast is not None and st.fast.dead:
            # the channel failed with nobody waiting on it (its error went to no one)
            why = st.fast.error
            assert why is not None
            self.end_stream(st, ExpertServerError(why.code, f"{self.describe_self()}: {why.message}"))
            st = None
        if st is None or st.dead is not None:
            if st is not None and st.fast is not None:
                st.fast.close()
            self._stream = None
            st = self._stream = self._open()
        return st

    def submit(
        self, generation: int, layer: int, x: torch.Tensor, b: pl.ServerBatch
    ) -> _GrpcReply | _FastReply:
        """Sends one layer's batch for this server; the reply's ``result`` is ``[T_s, H]``."""
        st = self.open_stream()
        dtype = self.dtype or x.dtype
        if st.fast is not None and st.dead is None:
            r = st.fast.send(next(self._seq), generation, layer, x, b.rows, b.slot_ids, b.weights, dtype)
            if r is not None:
                return _FastReply(self, st, r)
            self.fast_fallbacks += 1
        req = pb.ForwardRequest(
            generation=generation,
            layer=layer,
            hidden=wire.encode(x[b.rows.to(x.device)].to(dtype)),
            slot_ids=wire.encode(b.slot_ids),
            weights=wire.encode(b.weights),
        )
        return _GrpcReply(self.send(req))

    def send(self, req: pb.ForwardRequest) -> Future:
        st = self.open_stream()
        req.seq = next(self._seq)
        fut: Future = Future()
        with st.lock:
            if st.dead is not None:
                fut.set_exception(st.dead)
                return fut
            st.pending[req.seq] = fut
        st.requests.put(req)
        return fut

    def stream_alive(self) -> bool:
        st = self._stream
        return st is not None and st.dead is None and not (st.fast is not None and st.fast.dead)

    def close(self) -> None:
        self.reset("closing")
        self.channel.close()


def _status_error(spec: ServerSpec, e: grpc.RpcError) -> ExpertServerError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return ExpertServerError(code, f"expert server {spec.name} ({spec.address}): {code.name}: {details}")


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
        sent = [(b, self.conns[b.server].submit(self.placement.generation, layer, x, b)) for b in batches]

        def wait() -> torch.Tensor:
            out = torch.zeros_like(x)  # [T, H]
            deadline = time.monotonic() + self.cluster.timeout_s
            done = 0
            try:
                for b, reply in sent:
                    part = self._collect(b, reply, layer, x.shape[1], deadline)  # [T_s, H]
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
