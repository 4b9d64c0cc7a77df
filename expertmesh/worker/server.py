"""Expert server factory and entry point, shared by the GPU and CPU expert servers.

The configuration is :class:`~expertmesh.worker.config.WorkerConfig`; the worker itself is
the gRPC-free core (expertmesh/worker/core.py) behind the servicer (servicer.py).
``start_worker(config, backend)`` binds the port (0 = a free one), serves ExpertWorker +
grpc.health.v1 + reflection, and preloads the configured experts in the background: health is
NOT_SERVING until they are resident. ``serve(config, backend)`` runs it until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from expertmesh import cores, tls
from expertmesh.checkpoint import CheckpointReader
from expertmesh.errors import BindError
from expertmesh.experts import ExpertBackend
from expertmesh.health import LIVENESS
from expertmesh.metrics import serve_metrics
from expertmesh.net import grpc_options, host_id
from expertmesh.progress import LoadProgress
from expertmesh.transport import segment, tcp
from expertmesh.transport.tcp_server import DataListener
from expertmesh.v1 import expert_worker_pb2
from expertmesh.worker.config import WorkerConfig
from expertmesh.worker.core import WorkerIdentity
from expertmesh.worker.servicer import ExpertWorkerServicer, add_worker_servicer
from expertmesh.worker.slots import SlotTable, Views, parse_expert_spec, plain_views

__all__ = ["RunningWorker", "WorkerConfig", "grpc_options", "host_id", "serve", "start_worker"]

log = logging.getLogger("expertmesh.worker")
SERVICE = "expertmesh.v1.ExpertWorker"


@dataclass
class RunningWorker:
    server: grpc.aio.Server
    port: int
    servicer: ExpertWorkerServicer
    health: health.aio.HealthServicer
    preload: asyncio.Task
    metrics_port: int | None = None
    metrics_server: Any = None
    data: DataListener | None = None  # the TCP data path's listener (None: --no-tcp)

    @property
    def data_port(self) -> int | None:
        return self.data.port if self.data is not None else None

    async def drain(self, timeout: float) -> bool:
        """Graceful drain (SIGTERM): health NOT_SERVING and new streams refused with
        UNAVAILABLE at once; the open streams are still answered while the coordinators see the
        health (they poll it), mark this server as leaving (the placement holder re-places its
        experts on the rest), route around it once its experts have copies elsewhere and close
        their streams. Waits until every coordinator closed its stream and the layer being
        computed is done, at most ``timeout`` seconds; past it, layers are refused too (a
        coordinator still sending re-sends them to replicas). Returns whether it drained in
        time."""
        w = self.servicer.worker
        reason = f"expert server on port {self.port} is draining (shutting down)"
        # NOTE: refusing layers at once would end the streams before the coordinators read the
        # health: they would see a lost server, not a leaving one, and lose its only copies
        w.start_drain(reason, layers=False)
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while w.open_streams > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        w.start_drain(reason)
        streams = w.open_streams
        idle = await asyncio.to_thread(w.wait_idle, max(0.0, deadline - loop.time()))
        if streams or not idle:
            log.warning(
                "drain timeout (%gs): %d streams still open, computing: %s", timeout, streams, not idle
            )
            return False
        log.info("drained: no coordinator stream left")
        return True

    async def stop(self, grace: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        self.servicer.close()
        if self.data is not None:
            self.data.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()


def slot_views(backend: ExpertBackend) -> Views | None:
    """Where a slot's gate, up and down weights go in ``backend``'s layout, so the checkpoint
    is read straight into the slot: the backend's own ``slot_views`` (the CPU backend's
    interleaved rows), the plain halves for a backend that keeps weights as stored, None (read,
    then pack) otherwise. A wrapper (the CUDA graphs) answers for the backend inside it."""
    inner = _inner(backend)
    own = getattr(inner, "slot_views", None)
    if own is not None:
        return own
    return plain_views if type(inner).pack_weights is ExpertBackend.pack_weights else None


def _inner(backend: ExpertBackend) -> ExpertBackend:
    """The backend that lays out the slots: the one inside a wrapper (the CUDA graphs)."""
    inner = getattr(backend, "inner", backend)
    if not isinstance(inner, ExpertBackend):  # NUMA groups: one backend per node, its own stacking
        inner = backend
    return inner


def slot_table(
    reader: CheckpointReader,
    backend: ExpertBackend,
    dtype: torch.dtype,
    device: torch.device,
    capacity: int,
    staging_bytes: int | None = None,
    spare_bytes: int | None = None,
) -> SlotTable:
    """``backend``'s slot table: an expert server's, and the coordinator's in-process member's
    (coordinator/experts/local.py)."""
    # a backend that keeps experts as stored (FP8) reads them itself
    read = getattr(backend, "read_expert", None)
    hook = (lambda layer, e: read(reader, layer, e, device)) if read is not None else None
    stack = getattr(backend, "stack_slots", None)  # NUMA placement of the stacked slots
    return SlotTable(
        reader,
        dtype,
        device,
        capacity,
        backend.pack_weights,
        hook,
        stack,
        staging_bytes,
        slot_views(backend),
        spare_bytes,
        getattr(_inner(backend), "read_packed", None),  # quantised straight into the slots
    )


async def start_worker(config: WorkerConfig, backend: ExpertBackend, device_uuid: str = "") -> RunningWorker:
    cores.cap_default_executor()  # asyncio's helper pool, sized from this process's cores
    reader = CheckpointReader(config.model_dir)
    cfg = reader.config
    capacity = config.capacity or cfg.num_experts
    device = torch.device(config.device)
    slots = slot_table(
        reader, backend, config.torch_dtype, device, capacity, config.staging_bytes, config.spare_bytes
    )
    preload_ids = parse_expert_spec(config.experts, cfg.num_experts)
    identity = WorkerIdentity(
        kind=config.kind,
        device=config.device,
        host_id=host_id(),
        device_uuid=device_uuid,
        fast_paths=config.fast_paths,
        max_message_bytes=config.max_message_bytes,
    )
    if config.fast_paths:
        for name in segment.sweep():
            log.info("removed %s from %s (its creator is gone)", name, segment.SHM_DIR)
    # NOTE: the gRPC port is bound before the data port: a data port the kernel picks (--data-port
    # 0) could otherwise take a --port that was just freed (a server restarted on its port)
    server = grpc.aio.server(options=grpc_options(config.max_message_bytes))
    # TLS (mutual with --tls-ca) when configured
    port = tls.add_port(server, f"{config.host}:{config.port}", config.tls, require_client_cert=True)
    data = None
    if config.tcp:
        # NOTE: the gRPC port's host and certificate; its token checks happen in the handshake
        try:
            data = DataListener(config.host, config.data_port, tcp.server_context(config.tls))
        except OSError as e:  # one line naming the port and its flag, as for --port
            await server.stop(None)
            raise BindError(f"{config.host}:{config.data_port}", "--data-port", e.strerror or "") from None
    servicer = ExpertWorkerServicer(
        slots,
        backend,
        identity,
        config.shm_spin_us,
        config.max_loras,
        config.cluster_token,
        link=config.link,  # the device link
        data=data,
        combine=config.combine_streams,
        combine_wait_us=config.combine_wait_us,
    )
    if data is not None:
        data.on_drop = servicer.worker.data_path_error
    if not config.cluster_token:
        log.warning(
            "no cluster token: any client that reaches %s:%d can push this server a placement "
            "(start it with --cluster-token or EXPERTMESH_CLUSTER_TOKEN, the coordinator too)",
            config.host,
            config.port,
        )
    add_worker_servicer(servicer, server)  # malformed bytes -> INVALID_ARGUMENT
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        expert_worker_pb2.DESCRIPTOR.services_by_name["ExpertWorker"].full_name,
        reflection.SERVICE_NAME,
        health.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    await server.start()

    async def preload() -> None:
        loop = asyncio.get_running_loop()
        total = reader.expert_nbytes() * len(preload_ids) * len(cfg.moe_layer_ids)
        reader.progress = LoadProgress(f"{config.kind}-server experts", total)
        try:
            n = await loop.run_in_executor(None, slots.preload, preload_ids)
        finally:
            reader.progress.close()
            reader.progress = None
        log.info("preloaded %d expert weights (%d per layer)", n, len(preload_ids))
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    w = RunningWorker(server, port, servicer, health_servicer, asyncio.create_task(preload()), data=data)
    if config.metrics_port is not None:
        registry = servicer.worker.metrics.registry
        w.metrics_server, _, w.metrics_port = serve_metrics(registry, config.host, config.metrics_port)
    return w


def serve(config: WorkerConfig, backend: ExpertBackend, device_uuid: str = "") -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> int:
        w = await start_worker(config, backend, device_uuid)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if w.data is not None:
            tls = " (TLS)" if w.data.tls is not None else ""
            print(f"TCP data path on {config.host}:{w.data.port}{tls}", flush=True)
        print(f"{config.kind} expert server listening on {config.host}:{w.port}", flush=True)
        if w.metrics_port is not None:
            print(f"Prometheus metrics on http://{config.host}:{w.metrics_port}/metrics", flush=True)
        done, _ = await asyncio.wait(
            [asyncio.ensure_future(stop.wait()), w.preload], return_when=asyncio.FIRST_COMPLETED
        )
        if w.preload in done and w.preload.exception() is not None:
            log.error("preloading experts failed: %s", w.preload.exception())
            await w.stop(0)
            return 1
        await stop.wait()
        await w.drain(config.drain_timeout_s)  # SIGTERM/SIGINT drain first
        await w.stop()
        return 0

    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(main())
        return uvloop.run(main())
    except BindError as e:  # one line naming the port and its flag, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
