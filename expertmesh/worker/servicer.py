"""The ``expertmesh.v1.ExpertWorker`` servicer: a thin gRPC adapter around the worker core
(:class:`~expertmesh.worker.core.ExpertWorker`): decode (expertmesh.wire), hand to the core,
encode; typed errors become gRPC status codes here (expertmesh.status), by class.

A ``Forward`` stream whose first message is a fast-path handshake also gets a shared-memory
channel (expertmesh.transport.server) or a TCP data connection (expertmesh.transport.tcp_server):
its requests come through that channel's thread and go to the same core
(:meth:`ExpertWorker.forward_into`). A server with a cluster token opens a TCP data path only
for a stream that carries the token in its metadata.

Shapes: T tokens, H hidden.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch

from expertmesh import auth, status, tolerant, wire
from expertmesh.errors import ExpertMeshError, InvalidRequest, StaleGeneration
from expertmesh.experts import ExpertBackend
from expertmesh.lora.wire import decode_adapter
from expertmesh.safetensors_io import background_thread
from expertmesh.transport.handshake import Ack, HandshakeError, Hello
from expertmesh.transport.server import ShmServer
from expertmesh.transport.tcp_server import DataListener, TcpServer
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.worker.core import ExpertWorker, WorkerIdentity, WorkerStats
from expertmesh.worker.slots import SlotTable
from expertmesh.worker_api import ExpertRequest

__all__ = ["ExpertWorkerServicer", "WorkerIdentity", "WorkerStats", "add_worker_servicer"]

INLINE_MAX_TOKENS = 16  # requests this small skip the compute thread (see _run)


async def _abort(context: grpc.aio.ServicerContext, err: ExpertMeshError) -> None:
    await context.abort(status.grpc_code(err), err.message)


class ExpertWorkerServicer(pb_grpc.ExpertWorkerServicer):
    def __init__(
        self,
        slots: SlotTable,
        backend: ExpertBackend,
        identity: WorkerIdentity,
        shm_spin_us: float = 300.0,
        max_loras: int = 4,
        cluster_token: str | None = None,
        link: str = "auto",  # the device link's mode (WorkerConfig.link)
        data: DataListener | None = None,  # the TCP data path's port (None: not offered)
        combine: bool = False,  # WorkerConfig.combine_streams
        combine_wait_us: float = 0.0,  # WorkerConfig.combine_wait_us
    ) -> None:
        self.worker = ExpertWorker(slots, backend, identity, max_loras, combine, combine_wait_us)
        self.link = link
        self.data = data
        self.shm_spin_us = shm_spin_us
        self.cluster_token = cluster_token  # None: control RPCs are open (a warning at start)
        # NOTE: one compute thread for gRPC requests and commits (the core's lock orders them
        # with the fast-path channel threads); one loader thread for placement prepares and
        # releases, at background priority beside the requests (safetensors_io.background_thread)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="expert-compute")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="expert-load", initializer=background_thread)

    @property
    def stats(self) -> WorkerStats:
        return self.worker.stats

    async def Describe(self, request, context):
        return wire.encode_info(self.worker.info())

    async def Forward(
        self, request_iterator: AsyncIterator[pb.ForwardRequest], context
    ) -> AsyncIterator[pb.ForwardResponse]:
        loop = asyncio.get_running_loop()
        fast: ShmServer | TcpServer | None = None
        try:  # --- drain: a draining server opens no stream; open ones are counted
            self.worker.stream_opened()
        except ExpertMeshError as e:
            await _abort(context, e)
            return
        try:
            async for msg in request_iterator:
                try:
                    if isinstance(msg, InvalidRequest):  # bytes protobuf could not parse
                        raise msg
                    if msg.fast_path and msg.seq == 0 and fast is None:
                        fast, ack = await self._open_fast_path(msg.fast_path, context)
                        yield pb.ForwardResponse(seq=0, fast_path=ack.encode())
                        continue
                    if msg.fast_path:
                        raise InvalidRequest(
                            "a fast-path handshake must be the first message of a stream (seq 0)"
                        )
                    req = self.worker.check(wire.decode_request(msg))
                    t0 = time.perf_counter()
                    out = await self._run(loop, req)
                except ExpertMeshError as e:
                    self.worker.count_error(e)
                    await _abort(context, e)
                    return
                yield pb.ForwardResponse(
                    seq=msg.seq, output=wire.encode(out), compute_ms=(time.perf_counter() - t0) * 1e3
                )
        finally:
            self.worker.stream_closed()  # drain
            if fast is not None:
                fast.close()

    async def _run(self, loop: asyncio.AbstractEventLoop, req: ExpertRequest) -> torch.Tensor:
        # NOTE: decode-sized requests run right here when nobody else is computing: the hop to
        # the compute thread and back costs ~0.4 ms on a loaded host, more than their compute
        # (benchmarks/RESULTS.md). Never wait for the lock on the event loop.
        if req.tokens <= INLINE_MAX_TOKENS:
            out = self.worker.try_compute(req)
            if out is not None:
                return out
        return await loop.run_in_executor(self._compute, self.worker.compute, req)

    async def _open_fast_path(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> tuple[ShmServer | TcpServer | None, Ack]:
        try:
            hello = Hello.decode(raw)
        except HandshakeError as e:
            raise InvalidRequest(str(e)) from None
        if hello.transport == "tcp":
            return await self._open_tcp(hello, context)
        if "shm" not in self.worker.identity.fast_paths:
            return None, Ack("grpc", "this server offers no shared-memory fast path (--no-shm)")
        w = self.worker
        fast = ShmServer(
            hello, w.slots.device, w.forward, w.count_error, self.shm_spin_us, forward_into=w.forward_into,
            link=w, link_mode=self.link,
        )  # fmt: skip
        ack = await asyncio.wrap_future(fast.start())
        return (fast if ack.transport != "grpc" else None), ack

    async def _open_tcp(
        self, hello: Hello, context: grpc.aio.ServicerContext
    ) -> tuple[TcpServer | None, Ack]:
        if self.data is None:
            return None, Ack("grpc", "this server offers no TCP data path (--no-tcp)")
        try:
            auth.check_token(self.cluster_token, context.invocation_metadata(), "the TCP data path")
        except ExpertMeshError as e:
            self.worker.count_error(e)
            return None, Ack("grpc", e.message)
        w = self.worker
        fast = TcpServer(
            hello, self.data, w.slots.device, w.forward, w.data_path_error, self.shm_spin_us,
            forward_into=w.forward_into, max_buffer=w.identity.max_message_bytes or (256 << 20),
            link=w, link_mode=self.link, relay_tally=w.metrics.relays,
        )  # fmt: skip
        # NOTE: awaited: with a relay offered the stream's thread opens the worker's link first
        ack = await asyncio.wrap_future(fast.start())
        return (fast if ack.transport != "grpc" else None), ack

    async def ApplyPlacement(self, request, context):
        loop = asyncio.get_running_loop()
        phase, gen = request.phase, request.generation
        try:
            auth.check_token(self.cluster_token, context.invocation_metadata(), "ApplyPlacement")
            holder = self.worker.lease.may_push(request.lease_holder)
            if holder and phase != pb.ApplyPlacementRequest.ABORT:
                raise StaleGeneration(
                    f"coordinator {holder!r} holds the placement lease here; "
                    f"{request.lease_holder or 'a coordinator without one'!r} may not push placements"
                )
            if phase == pb.ApplyPlacementRequest.PREPARE:
                table = {ls.layer: list(ls.experts) for ls in request.layers}
                read = await loop.run_in_executor(self._loader, self.worker.prepare, gen, table)
                return pb.ApplyPlacementResponse(generation=self.worker.generation, experts_loaded=read)
            if phase == pb.ApplyPlacementRequest.COMMIT:
                await loop.run_in_executor(self._compute, self.worker.commit, gen, False)
                # NOTE: after the reply, on the loader thread: the coordinator commits between two
                # of its steps and waits for every server's reply, and handing GBs back to the
                # CUDA driver or the OS (empty_cache, malloc_trim) need not sit in that window
                self._loader.submit(self.worker.release)
            elif phase == pb.ApplyPlacementRequest.ABORT:
                self.worker.abort(gen)
            else:
                raise InvalidRequest("phase must be PREPARE, COMMIT or ABORT")
        except ExpertMeshError as e:
            await _abort(context, e)
        return pb.ApplyPlacementResponse(generation=self.worker.generation)

    async def LoadAdapter(self, request, context):
        await self._control(context, "LoadAdapter")
        w = self.worker
        cfg = w.cfg
        try:
            layers = decode_adapter(
                request.tensors, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                w.slots.moe_layers, w.slots.dtype,
            )  # fmt: skip
            if request.scaling not in (0.0, 1.0):
                raise ValueError(f"scaling {request.scaling}: B must come with the scaling folded in (1)")
            w.load_adapter(request.adapter_slot, request.name, layers, request.source)
        except ValueError as e:
            await _abort(context, InvalidRequest(f"adapter {request.name!r}: {e}"))
        except InvalidRequest as e:
            await _abort(context, e)
        return pb.LoadAdapterResponse()

    async def UnloadAdapter(self, request, context):
        await self._control(context, "UnloadAdapter")
        # NOTE: idempotent (unknown names are a no-op), so a rollback may unload everywhere
        self.worker.unload_adapter(request.name)
        return pb.UnloadAdapterResponse()

    async def _control(self, context: grpc.aio.ServicerContext, what: str) -> None:
        """Aborts a control RPC that lacks the cluster token (when this server has one)."""
        try:
            auth.check_token(self.cluster_token, context.invocation_metadata(), what)
        except ExpertMeshError as e:
            await _abort(context, e)

    async def Stats(self, request, context):
        w = self.worker
        s = w.stats
        empty = np.zeros(0, dtype=np.int64)
        layers = [
            pb.LayerStats(
                layer=layer,
                tokens_per_slot=w.tokens_per_slot.get(layer, empty).tolist(),
                tokens_per_expert=w.tokens_per_expert.get(layer, empty).tolist(),
            )
            for layer in sorted(set(w.tokens_per_slot) | set(w.tokens_per_expert))
        ]
        return pb.StatsResponse(
            requests=s.requests,
            tokens=s.tokens,
            errors=s.errors,
            compute_seconds=s.compute_seconds,
            layers=layers,
            generation=w.generation,
        )

    async def PlacementLease(self, request, context):
        await self._control(context, "PlacementLease")
        lease = self.worker.lease
        try:
            if request.observe:
                st = lease.observe(request.holder)
            elif request.release:
                st = lease.release(request.holder)
            else:
                st = lease.acquire(request.holder, request.ttl_ms / 1e3)
        except ValueError as e:
            await _abort(context, InvalidRequest(str(e)))
        w = self.worker
        sources = w.adapter_sources
        return pb.PlacementLeaseResponse(
            granted=st.granted,
            holder=st.holder,
            ttl_left_ms=int(st.left_s * 1e3),
            generation=w.generation,
            adapters=[
                pb.AdapterName(name=n, adapter_slot=i, source=sources.get(n, ""))
                for i, n in sorted(w.lora.names().items())
            ],
        )

    async def LivePlacement(self, request, context):
        live = self.worker.slots.live
        layers = [pb.LayerSlots(layer=layer, experts=ls.experts) for layer, ls in sorted(live.layers.items())]
        return pb.LivePlacementResponse(generation=live.generation, layers=layers)

    def close(self) -> None:
        self._compute.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------- registration


def add_worker_servicer(servicer: ExpertWorkerServicer, server: grpc.aio.Server) -> None:
    """``add_ExpertWorkerServicer_to_server`` whose deserializers turn malformed bytes into
    INVALID_ARGUMENT (counted with the worker's errors on Forward)."""
    tolerant.add_service(servicer, server, pb.DESCRIPTOR.services_by_name["ExpertWorker"])
