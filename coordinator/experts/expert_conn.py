"""One expert server seen from the coordinator: channel, ``Describe``, placement phases, and the
long-lived ``Forward`` stream (pipelined by sequence number, read by its own thread), with the
shared-memory / CUDA IPC fast path or the TCP data path negotiated on it (expertmesh.transport).

This is the coordinator's gRPC edge: gRPC errors become :class:`ExpertServerError` (a typed
library error plus its status code) here and nowhere else. The connection does not decide when
to connect or what state the server is in: the cluster (coordinator/experts/cluster.py) does; the
connection tells it through ``on_down`` when its stream dies.

Shapes: T_s rows sent to the server, H hidden.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import NoReturn

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from expertmesh import auth, errors, status, tls, wire
from expertmesh.net import device_uuid, grpc_options
from expertmesh.transport import cuda_ipc, negotiate
from expertmesh.transport import descriptor as dsc
from expertmesh.transport.client import LinkAreas, Reply, ShmClient
from expertmesh.transport.errors import MalformedAnswer, Rejected
from expertmesh.transport.handshake import Ack, HandshakeError
from expertmesh.transport.tcp import TcpError, split_address
from expertmesh.transport.tcp_client import TcpClient, TcpReply
from expertmesh.transport.tcp_relay import RelayTally
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.worker_api import ExpertRequest, WorkerInfo


def _launched() -> str:  # a link step already answered "launched" (ServerConnection.send_link_step)
    return ""


log = logging.getLogger("expertmesh.remote")


class ExpertServerError(RuntimeError):
    """An expert server failed, timed out or is unavailable: ``error`` is the typed library
    error, ``code`` the grpc.StatusCode the coordinator answers its own clients with."""

    def __init__(
        self, code: grpc.StatusCode, message: str, error: errors.ExpertMeshError | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.error = error if error is not None else errors.from_status(status.status_of(code), message)
        # the step's token rows that need an expert no live server holds (None: the whole step):
        # the scheduler fails only the requests of those rows and runs the step again for the rest
        self.rows: tuple[int, ...] | None = None

    @classmethod
    def of(cls, err: errors.ExpertMeshError) -> ExpertServerError:
        return cls(status.grpc_code(err), err.message, err)


@dataclass
class _Stream:
    call: grpc.Future  # the streaming call (also an iterator of responses)
    requests: queue.Queue
    pending: dict[int, Future] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    dead: ExpertServerError | None = None
    fast: ShmClient | TcpClient | None = None  # the stream's fast channel, if it has one


class GrpcReply:
    """An answer due on the gRPC stream."""

    def __init__(self, fut: Future, conn: ServerConnection | None = None, layer: int = -1) -> None:
        self.fut, self.conn, self.layer = fut, conn, layer
        self.compute_ms: float | None = None  # the server's own compute time (EPLB speeds)

    def result(self, timeout: float) -> torch.Tensor:  # [T_s, H]
        resp = self.fut.result(timeout=timeout)
        self.compute_ms = resp.compute_ms
        try:
            return wire.decode(resp.output, "output")
        except wire.WireError as e:  # the server's fault, not the request's
            assert self.conn is not None  # a reply with no connection never got an answer
            raise self.conn.bad_answer(self.layer, e.message) from None

    def release(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class FastReply:
    """An answer due on the stream's fast path (its output is a view into the ring)."""

    def __init__(self, conn: ServerConnection, st: _Stream, reply: Reply | TcpReply, layer: int = -1) -> None:
        self.conn, self.st, self.reply, self.layer = conn, st, reply, layer

    def result(self, timeout: float) -> torch.Tensor:  # [T_s, H], a view valid until release()
        try:
            return self.reply.result(timeout)
        except Rejected as e:  # the fast channel's failure, with its gRPC status
            if self.st.dead is not None:  # the stream died: its error says why
                raise self.st.dead from None
            if isinstance(e.error, MalformedAnswer):  # a server fault, it fails over
                raise self.conn.bad_answer(self.layer, e.message, self.st) from None
            # the server refused the request: as on the gRPC path, that ends the stream
            err = ExpertServerError(
                e.code, f"{self.conn.describe_self()}: {e.code.name}: {e.message}", e.error
            )
            self.conn.end_stream(self.st, err)
            raise err from None

    @property
    def compute_ms(self) -> float:
        """The server's own time for this request (from the ring's or the frame's answer, once
        result() returned): EPLB's server speeds, as on the gRPC path."""
        return self.reply.server_ms

    def release(self) -> None:
        self.reply.release()

    def abandon(self) -> None:
        self.reply.abandon()


ExpertReply = GrpcReply | FastReply  # what submit() returns: result(timeout) -> [T_s, H]


class ServerConnection:
    """One expert server: channel, description, placement phases, the Forward stream."""

    def __init__(self, spec: ServerSpec, cluster: ClusterConfig, device: torch.device | None = None) -> None:
        self.spec, self.cluster = spec, cluster
        self.device = device or torch.device("cpu")
        self.channel = self._channel(spec.address)
        self.stub = pb_grpc.ExpertWorkerStub(self.channel)
        self.info: WorkerInfo | None = None
        self.dtype: torch.dtype | None = None
        self.slots_used = 0
        self.on_down: Callable[[ExpertServerError], None] = lambda err: None  # set by the cluster
        self._stream: _Stream | None = None
        self._open_lock = threading.Lock()  # the cluster's thread and callers of open_stream
        self._seq = itertools.count(1)
        self.plan = "grpc"  # data path chosen from Describe (negotiate.choose)
        self.transport = "grpc"  # the path of the current stream (the handshake may settle lower)
        self.transport_note = ""  # why nothing faster
        self.fast_fallbacks = 0  # requests sent over gRPC on a fast stream (no room in the ring)
        # (R, H, K) of the device link to offer (set by the remote dispatcher on a CUDA
        # coordinator); None: never offered
        self.link_shape: tuple[int, int, int] | None = None
        self.link_note = "not offered"  # why the current stream has no device link
        # why decode steps of a live link run without it now ("": they link), e.g. the GPU is
        # shared (coordinator/model/remote_graphs.py sets it)
        self.link_pause = ""
        self._retry_tcp = ""  # auto: why shared memory failed, when a tcp stream is to replace it
        self.relays = RelayTally()  # the relayed links' counters over every stream (metrics)
        # this coordinator's id in placement pushes when several share the servers ("": none)
        self.lease_holder = ""

    def _channel(self, address: str) -> grpc.Channel:
        return tls.channel(  # TLS with the coordinator's --tls-* flags
            address,
            self.cluster.tls,
            options=[
                *grpc_options(self.cluster.max_message_mb << 20),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )

    def retarget(self, address: str) -> None:
        """Points this connection at another server (a new address behind its DNS name): the
        stream and channel to the old one are closed; the cluster's reconnection describes the
        new one and gives it this server's slots. Called with the server marked down."""
        self.reset(f"replaced by {address}")
        old = self.channel
        self.spec = replace(self.spec, address=address)
        self.channel = self._channel(address)
        self.stub = pb_grpc.ExpertWorkerStub(self.channel)
        self.info = None
        old.close()

    def describe_self(self) -> str:
        return f"expert server {self.spec.name} ({self.spec.address})"

    def bad_answer(self, layer: int, what: str, st: _Stream | None = None) -> ExpertServerError:
        """The server answered ``layer`` with something that is not its output.
        That is the server failing the layer, as if it had died: its stream ends (the cluster
        marks it down through ``on_down`` and brings it back as for any loss), and the
        returned UNAVAILABLE error sends the rows to live replicas (coordinator/experts/remote.py)."""
        err = ExpertServerError.of(
            MalformedAnswer(f"{self.describe_self()} answered layer {layer} with a malformed output: {what}")
        )
        log.error("%s; marking it down, its rows go to live replicas", err)
        st = st if st is not None else self._stream
        if st is not None:
            self.end_stream(st, err)
        return err

    # ------------------------------------------------------------ control plane

    def describe(self, timeout: float) -> WorkerInfo:
        try:
            info = wire.decode_info(self.stub.Describe(pb.DescribeRequest(), timeout=timeout))
        except grpc.RpcError as e:
            raise _status_error(self.spec, e) from None
        self.info, self.dtype = info, info.dtype
        return info

    def plan_transport(self, info: WorkerInfo, local: negotiate.Side) -> None:
        """Chooses this server's data path from its description (the next stream uses it)."""
        offer = negotiate.Side(info.host_id, info.device_uuid, info.fast_paths)
        if (
            local.device_uuid
            and info.device_uuid
            and info.device_uuid != local.device_uuid
            and not local.peers
        ):
            # a server on another GPU of this host: CUDA IPC if our GPU reaches its by peer access
            local = dataclasses.replace(local, peers=cuda_ipc.peer_uuids(self.device))
        try:
            choice = negotiate.choose(self.cluster.transport, local, offer, self.spec.name)
        except negotiate.NegotiationError as e:
            raise ExpertServerError.of(errors.Incompatible(f"{self.describe_self()}: {e}")) from None
        if choice.transport != self.plan:
            self.reset("the data path changes")
        self.plan, self.transport_note = choice.transport, choice.reason

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
                raise ExpertServerError.of(
                    errors.Unavailable(f"{self.spec.name} ({self.spec.address}) is not SERVING yet")
                )
            time.sleep(0.1)

    def serving(self, timeout: float) -> bool:
        """False when the server's health says NOT_SERVING (it drains or is not ready); an
        unreachable server counts as serving here (its stream reports that loss)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            st = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status
        except grpc.RpcError:
            return True
        return st == health_pb2.HealthCheckResponse.SERVING

    def retire_stream(self, reason: str, timeout: float) -> None:
        """Ends the stream once the answers due on it arrived (at most ``timeout`` s): a
        draining server finishes its in-flight layers and sees its stream closed."""
        st = self._stream
        deadline = time.monotonic() + timeout
        while st is not None and st.pending and st.dead is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if st is not None and self._stream is st:
            self.end_stream(st, ExpertServerError.of(errors.Unavailable(f"{self.describe_self()}: {reason}")))

    def prepare(self, generation: int, table: dict[int, list[int]], timeout: float) -> None:
        """Phase 1: the server loads ``table`` (layer -> expert per local slot) beside its live set."""
        layers = [pb.LayerSlots(layer=layer, experts=ex) for layer, ex in sorted(table.items())]
        self._apply(pb.ApplyPlacementRequest.PREPARE, generation, timeout, layers)
        self.slots_used = max((len(x) for x in table.values()), default=0)

    def commit(self, generation: int, timeout: float) -> None:
        self._apply(pb.ApplyPlacementRequest.COMMIT, generation, timeout)

    def abort(self, generation: int, timeout: float) -> None:
        self._apply(pb.ApplyPlacementRequest.ABORT, generation, timeout)

    def load_adapter(
        self, adapter_slot: int, name: str, tensors: dict, timeout: float, source: str = ""
    ) -> None:
        """MoE LoRA: the server keeps adapter ``name`` (its experts' part) as ``adapter_slot``."""
        req = pb.LoadAdapterRequest(
            name=name, adapter_slot=adapter_slot, tensors=tensors, scaling=1.0, source=source
        )
        try:
            self.stub.LoadAdapter(req, timeout=timeout, metadata=auth.metadata(self.cluster.cluster_token))
        except grpc.RpcError as e:
            raise _status_error(self.spec, e) from None

    def unload_adapter(self, name: str, timeout: float) -> None:
        try:
            self.stub.UnloadAdapter(
                pb.UnloadAdapterRequest(name=name),
                timeout=timeout,
                metadata=auth.metadata(self.cluster.cluster_token),
            )
        except grpc.RpcError as e:
            raise _status_error(self.spec, e) from None

    def lease(self, holder: str, ttl_s: float, timeout: float, release: bool = False, observe: bool = False):
        """The server's placement lease: take or renew it, give it up, or only look
        (``PlacementLeaseResponse``: granted, holder, generation, adapters held)."""
        req = pb.PlacementLeaseRequest(
            holder=holder, ttl_ms=int(ttl_s * 1e3), release=release, observe=observe
        )
        try:
            return self.stub.PlacementLease(
                req, timeout=timeout, metadata=auth.metadata(self.cluster.cluster_token)
            )
        except grpc.RpcError as e:
            raise _status_error(self.spec, e) from None

    def live_placement(self, timeout: float) -> tuple[int, dict[int, list[int]]]:
        """The server's live generation and slot table (layer -> logical expert per slot)."""
        try:
            r = self.stub.LivePlacement(pb.LivePlacementRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise _status_error(self.spec, e) from None
        return r.generation, {ls.layer: list(ls.experts) for ls in r.layers}

    def expert_tokens(self, timeout: float) -> dict[int, list[int]]:
        """The server's tokens per logical expert since it started: layer -> [E]."""
        try:
            r = self.stub.Stats(pb.StatsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            raise _status_error(self.spec, e) from None
        return {ls.layer: list(ls.tokens_per_expert) for ls in r.layers if ls.tokens_per_expert}

    def _apply(self, phase: int, generation: int, timeout: float, layers: list | None = None) -> None:
        req = pb.ApplyPlacementRequest(
            phase=phase,  # type: ignore[arg-type]
            generation=generation,
            layers=layers or [],
            lease_holder=self.lease_holder,
        )
        try:
            self.stub.ApplyPlacement(req, timeout=timeout, metadata=auth.metadata(self.cluster.cluster_token))
        except grpc.RpcError as e:
            raise _status_error(self.spec, e) from None

    # ------------------------------------------------------------ data plane

    def _open(self) -> _Stream:
        q: queue.Queue = queue.Queue()
        # NOTE: the cluster token rides on the stream: a server that has one opens its TCP data
        # path only for a stream that carries it
        call = self.stub.Forward(iter(q.get, None), metadata=auth.metadata(self.cluster.cluster_token))
        st = _Stream(call, q)
        threading.Thread(target=self._read, args=(st,), daemon=True, name=f"read-{self.spec.name}").start()
        self.transport = "grpc"
        if self.plan != "grpc":
            self._handshake(st)
        if self._retry_tcp:
            # NOTE: auto planned shared memory (same boot id) and the server could not open our
            # segment: another /dev/shm on this host (containers). The TCP data path does not
            # need one; a handshake opens a stream, so this one goes and a tcp one replaces it.
            why, self._retry_tcp = self._retry_tcp, ""
            with st.lock:  # NOTE: dead first: its end is no loss of the server (no on_down)
                st.dead = ExpertServerError.of(
                    errors.Cancelled(f"{self.spec.name}: replaced by a tcp stream")
                )
            st.requests.put(None)
            st.call.cancel()
            self.plan = "tcp"
            st = self._open()
            self.transport_note = self.transport_note or why
        return st

    def _handshake(self, st: _Stream) -> None:
        """Offers the planned fast path on a new stream and settles for the server's answer."""
        # NOTE: two GPUs order their work by synchronising each side's stream ("local"): no
        # interprocess event has to cross between the devices
        theirs = self.info.device_uuid if self.info is not None else ""
        sync = (
            "local" if self.plan == "cuda_ipc" and theirs and theirs != device_uuid(self.device) else "host"
        )
        link = self._link_offer(sync)
        fast: ShmClient | TcpClient
        try:
            if self.plan == "tcp":
                fast = TcpClient(
                    self.cluster.shm_ring_bytes,
                    self.device,
                    self.cluster.shm_spin_us,
                    tls=self.cluster.tls,
                    data_address=self.spec.data_address,
                    server_host=split_address(self.spec.address)[0],
                    stall_s=self.cluster.timeout_s,
                    link=link,
                    link_layers=len(self.info.moe_layers) if self.info is not None else 0,
                    relay_tally=self.relays,
                )
            else:
                fast = ShmClient(
                    self.plan,
                    self.cluster.shm_ring_bytes,
                    self.device,
                    self.cluster.shm_spin_us,
                    cuda_sync=sync,
                    link=link,
                )
        except (OSError, ValueError, cuda_ipc.CudaIpcError, torch.OutOfMemoryError) as e:
            self._settle(st, None, Ack("grpc", f"cannot create the {self.plan} channel here: {e}"))
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
                ExpertServerError.of(
                    errors.Unavailable(f"{self.describe_self()}: fast-path handshake: {why}")
                ),
            )
            assert st.dead is not None
            raise st.dead from None
        self._settle(st, fast, ack)

    def _link_offer(self, sync: str) -> tuple[int, int, int, torch.dtype] | None:
        """The link's (R, H, K, dtype) to offer: the device link on a cuda_ipc stream between
        two GPUs (sync "local": each side's spinning wait has its own GPU), on one GPU only
        with EXPERTMESH_LINK=force (two processes' spinning kernels time-slice there); the
        host link on a shm stream to a CPU server (its areas in our segment, polled by a C
        thread there: cpu_expert_server/hostlink.py); on a tcp stream, a host link over our
        own areas that a relay carries to the server (expertmesh/transport/tcp_relay.py)."""
        mode = self.cluster.device_link
        why = ""
        cpu_server = self.info is not None and self.info.kind == "cpu"
        if self.link_shape is None or self.dtype is None:
            why = "not a CUDA coordinator's remote dispatcher"
        elif mode == "off":
            why = "EXPERTMESH_LINK=0"
        elif self.plan == "tcp" and self._same_gpu() and mode != "force":
            why = "the server computes on this GPU: two processes' spinning kernels would time-slice it"
        elif (self.plan == "shm" and cpu_server) or self.plan == "tcp":
            pass  # the host link, in shared memory or relayed over TCP
        elif self.plan != "cuda_ipc":
            why = f"the data path is {self.plan}, not cuda_ipc, tcp (or shm to a CPU server)"
        elif sync != "local" and mode != "force":
            why = "the server shares this GPU (EXPERTMESH_LINK=force links anyway)"
        self.link_note = why
        if why:
            return None
        assert self.link_shape is not None and self.dtype is not None
        return (*self.link_shape, self.dtype)

    def _same_gpu(self) -> bool:
        theirs = self.info.device_uuid if self.info is not None else ""
        return bool(theirs) and self.device.type == "cuda" and theirs == device_uuid(self.device)

    def link(self) -> LinkAreas | None:
        """The live stream's device link (None: none now)."""
        st = self._stream
        if st is None or st.dead is not None or st.fast is None:
            return None
        return st.fast.link

    def link_step(
        self, step: int, rows: int, bucket: int, generation: int, timeout_s: float, micro: int = 1
    ) -> str:
        """Asks the server to launch its step graph for a linked decode step; "" when
        it did, else why not (a refusal, or the channel is gone: the step runs without the link,
        and the piecewise path meets a dead server as usual). No answer within ``timeout_s``:
        the stream is reset and the error raised (the server is hung)."""
        sent = self.send_link_step(step, rows, bucket, generation, timeout_s, micro)
        return sent if isinstance(sent, str) else sent()

    def send_link_step(
        self, step: int, rows: int, bucket: int, generation: int, timeout_s: float, micro: int = 1
    ) -> str | Callable[[], str]:
        """:meth:`link_step` in two halves: sends the step and returns the call that reads the
        server's answer ("" launched, else why not; raises as link_step does), or why it could
        not be sent. Over a shared-memory channel the answer is not waited for here, so the
        coordinator launches its own side of the step while the server launches its own; a
        relayed (TCP) link is answered here (its relay starts only on a launched step)."""
        st = self._stream
        if st is None or st.fast is None or st.dead is not None:
            return "no fast stream"
        fast = st.fast
        # NOTE: servers take waits of at most 10 minutes (gpu_server/link_graphs.py MAX_TIMEOUT_MS)
        timeout_ms = min(max(1, int(timeout_s * 1e3)), 600_000)
        desc = dsc.LinkStep(self.next_seq(), step, rows, bucket, generation, timeout_ms, micro)
        if not isinstance(fast, ShmClient):
            why = self._link_answer(lambda: fast.link_step(desc, time.monotonic() + timeout_s), timeout_s)
            return why or _launched
        try:
            fast.send_link_step(desc)
        except Rejected as e:
            return f"the fast-path channel is gone: {e.message}"
        except OSError as e:
            return f"the fast-path channel is gone: {e}"
        return lambda: self._link_answer(
            lambda: fast.link_answer(desc.seq, time.monotonic() + timeout_s), timeout_s
        )

    def _link_answer(self, answer: Callable[[], dsc.Response], timeout_s: float) -> str:
        try:
            resp = answer()
        except Rejected as e:
            return f"the fast-path channel is gone: {e.message}"
        except FutureTimeout:
            self.reset(f"no answer to a device-link step within {timeout_s:g}s")
            raise ExpertServerError.of(
                errors.DeadlineExceeded(
                    f"{self.describe_self()} did not answer a device-link step within {timeout_s:g}s"
                )
            ) from None
        return "" if resp.code == 0 else f"refused ({resp.code}): {resp.message}"

    def _settle(self, st: _Stream, fast: ShmClient | TcpClient | None, ack: Ack) -> None:
        """Takes the server's answer (``auto`` accepts a slower path, a required path does not)."""
        requested = self.cluster.transport
        if not negotiate.acceptable(requested, self.plan, ack.transport):
            why = f"{self.describe_self()} answered {ack.transport}: {ack.reason}"
            self._refuse(st, fast, f"--transport {requested}: {why}")
        # NOTE: the plan's reason stays when the server takes the plan (why nothing faster)
        self.transport_note = ack.reason or self.transport_note
        if ack.transport == "grpc":
            if fast is not None:
                fast.close()
            offers = self.info.fast_paths if self.info is not None else ()
            if requested == "auto" and self.plan in ("shm", "cuda_ipc") and "tcp" in offers:
                self._retry_tcp = ack.reason or "the server answered plain gRPC"
                log.info("%s: no shared memory (%s); trying the tcp data path", self.spec.name, ack.reason)
                return
            if self.plan == "grpc":
                log.info("%s: plain gRPC (%s)", self.spec.name, ack.reason)
            else:
                # NOTE: loud: the negotiation found a faster path both sides can use, so a user
                # expects it and every layer now pays gRPC's copies instead
                log.warning(
                    "%s: the %s fast path is lost, every layer goes over plain gRPC (slower): %s",
                    self.spec.name,
                    self.plan,
                    ack.reason,
                )
            return
        assert fast is not None
        if isinstance(fast, TcpClient):
            try:
                fast.accept(ack)
            except TcpError as e:
                if requested != "auto":
                    self._refuse(st, fast, f"{self.describe_self()}: --transport {requested}: {e}")
                # NOTE: auto goes on over plain gRPC on this stream (the server's side of the
                # data path gives up waiting for us); the next stream tries tcp again
                fast.close()
                self.transport_note = str(e)
                log.warning("%s: plain gRPC (%s)", self.spec.name, e)
                return
            st.fast, self.transport = fast, fast.transport
            log.info("%s: tcp data path to %s", self.spec.name, fast.peer)
            if not self.link_note:  # offered; the server's answer says whether it is up
                self.link_note = fast.link_reason
                if fast.link is not None:
                    log.info("%s: relayed link up (%d rows)", self.spec.name, fast.link.rows)
                else:
                    log.info("%s: no relayed link: %s", self.spec.name, fast.link_reason)
            return
        try:
            fast.accept(ack)
        except cuda_ipc.CudaIpcError as e:
            if requested == "auto":
                self.plan = "shm"  # the next stream asks for less
            self._refuse(st, fast, f"{self.describe_self()}: cannot map its CUDA IPC output ring: {e}")
        st.fast, self.transport = fast, fast.transport
        if not self.link_note:  # offered; the server's answer says whether it is up
            self.link_note = fast.link_reason
            if fast.link is not None:
                kind = "host" if fast.link.host else "device"
                log.info("%s: %s link up (%d rows)", self.spec.name, kind, fast.link.rows)
            else:
                log.info("%s: no device link: %s", self.spec.name, fast.link_reason)

    def _refuse(self, st: _Stream, fast: ShmClient | TcpClient | None, message: str) -> NoReturn:
        if fast is not None:
            fast.close()
        err = ExpertServerError.of(errors.Incompatible(message))
        self.end_stream(st, err)
        raise err

    def _read(self, st: _Stream) -> None:
        try:
            for resp in st.call:
                with st.lock:
                    fut = st.pending.pop(resp.seq, None)
                if fut is not None:
                    fut.set_result(resp)
            err = ExpertServerError.of(errors.Unavailable(f"{self.spec.name}: stream closed"))
        except grpc.RpcError as e:
            err = _status_error(self.spec, e)
        self._fail(st, err)

    def _fail(self, st: _Stream, err: ExpertServerError) -> None:
        with st.lock:
            first = st.dead is None
            if first:  # NOTE: the first error says why; the cancellation that follows does not
                st.dead = err
            pending, st.pending = st.pending, {}
        # NOTE: ends the request iterator: gRPC's thread that consumes it would otherwise wait
        # on this dead stream's queue forever (one leaked thread per lost server)
        st.requests.put(None)
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(st.dead)
        if st.fast is not None:
            st.fast.kill(Rejected(err.error))
        # NOTE: a refused request (bad input, stale generation) ends the stream, not the server
        if first and not isinstance(err.error, (errors.InvalidRequest, errors.StaleGeneration)):
            self.on_down(err)

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
            self.end_stream(st, ExpertServerError.of(errors.DeadlineExceeded(f"{self.spec.name}: {reason}")))

    def open_stream(self) -> _Stream:
        """The live stream, opened (with its handshake) if there is none. Called by the
        cluster's bring-up, never by the step path (:meth:`submit` fails on a dead stream)."""
        with self._open_lock:
            return self._open_stream()

    def _open_stream(self) -> _Stream:
        st = self._stream
        if st is not None and st.dead is None and st.fast is not None and st.fast.dead:
            # the channel failed with nobody waiting on it (its error went to no one)
            why = st.fast.error
            assert why is not None
            self.end_stream(
                st, ExpertServerError(why.code, f"{self.describe_self()}: {why.message}", why.error)
            )
            st = None
        if st is None or st.dead is not None:
            if st is not None and st.fast is not None:
                st.fast.close()
            self._stream = None
            st = self._stream = self._open()
        return st

    def next_seq(self) -> int:
        """The sequence number for the next request to this server (seq 0 is the handshake)."""
        return next(self._seq)

    def stage(self, x: torch.Tensor, top_k: int) -> None:
        """Copies ``x [T, H]`` into the fast path's ring ahead of the request that sends all of
        it (ShmClient.stage); nothing without a fast stream."""
        st = self._stream
        if st is not None and st.fast is not None and st.dead is None:
            st.fast.stage(x, self.dtype or x.dtype, top_k)

    def submit(self, req: ExpertRequest) -> ExpertReply:
        """Sends one layer's request over the live stream (fast path if it has room); the
        reply's ``result`` is ``[T_s, H]``. No stream: the reply fails at once (the cluster
        reconnects; the step path never does)."""
        st = self._stream
        if st is None:
            fut: Future = Future()
            fut.set_exception(
                ExpertServerError.of(errors.Unavailable(f"{self.describe_self()}: no open stream"))
            )
            return GrpcReply(fut)
        dtype = self.dtype or req.hidden.dtype
        if st.fast is not None and st.dead is None:
            r = st.fast.send(req, dtype)
            if r is not None:
                return FastReply(self, st, r, req.layer)
            self.fast_fallbacks += 1
        return GrpcReply(self._send(st, wire.encode_request(req, dtype)), self, req.layer)

    def _send(self, st: _Stream, msg: pb.ForwardRequest) -> Future:
        fut: Future = Future()
        with st.lock:
            if st.dead is not None:
                fut.set_exception(st.dead)
                return fut
            st.pending[msg.seq] = fut
        st.requests.put(msg)
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
    message = f"expert server {spec.name} ({spec.address}): {code.name}: {details}"
    return ExpertServerError(code, message, errors.from_status(status.status_of(code), message))
