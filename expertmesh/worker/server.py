"""Expert server factory and entry point, shared by the GPU and CPU expert servers.

``start_worker(config, backend)`` binds the port (0 = a free one), serves ExpertWorker +
grpc.health.v1 + reflection, and preloads the configured experts in the background: health is
NOT_SERVING until they are resident. ``serve(config, backend)`` runs it until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from expertmesh import cores, wire
from expertmesh.checkpoint import CheckpointReader
from expertmesh.experts import ExpertBackend
from expertmesh.transport import segment
from expertmesh.v1 import expert_worker_pb2, expert_worker_pb2_grpc
from expertmesh.worker.servicer import ExpertWorkerServicer, WorkerIdentity
from expertmesh.worker.slots import SlotTable, parse_expert_spec

log = logging.getLogger("expertmesh.worker")
SERVICE = "expertmesh.v1.ExpertWorker"


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def host_id() -> str:
    """Boot id: two processes with the same value run on the same host (kernel)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class WorkerConfig:
    kind: str  # "gpu" | "cpu"
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    experts: str = "all"  # preloaded before any placement arrives: all | none | 0-15,32
    capacity: int | None = None  # local slots per layer; default: the model's expert count
    max_message_mb: int = 256
    shm: bool = True  # offer the shared-memory (and, on CUDA, CUDA IPC) fast paths
    # fast paths: poll this long for the next request before sleeping (0 where cores are scarce)
    shm_spin_us: float = field(default_factory=cores.default_spin_us)

    def __post_init__(self) -> None:
        assert self.kind in ("gpu", "cpu"), f"{self.kind=}"
        wire.parse_dtype(self.dtype)
        assert self.dtype in ("float32", "bfloat16", "float16"), f"{self.dtype=}"
        assert 0 <= self.port < 65536, f"{self.port=}"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"--device {self.device}: CUDA is not available on this machine (use --device cpu)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return wire.parse_dtype(self.dtype)

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb << 20

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
        p.add_argument("--model", required=True, help="HF checkpoint directory (shared with the coordinator)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=default_port, help="0 = a free port (printed)")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--experts", default="all", help="experts to preload per layer: all | none | 0-15,32")
        p.add_argument(
            "--capacity", type=int, default=None, help="local slots per layer (default: expert count)"
        )
        p.add_argument("--max-message-mb", type=int, default=256)
        p.add_argument(
            "--no-shm",
            action="store_true",
            help="offer no shared-memory or CUDA IPC fast path: coordinators on this host use gRPC",
        )
        p.add_argument(
            "--shm-spin-us",
            type=float,
            default=cores.default_spin_us(),
            help="fast paths: poll this long for the next request before sleeping (0 = always sleep; "
            "default: %(default)g here, 0 unless there are more cores than the 3 processes of a cluster)",
        )

    @property
    def fast_paths(self) -> tuple[str, ...]:
        if not self.shm or not segment.available():
            return ()
        return ("shm", "cuda_ipc") if self.device.startswith("cuda") else ("shm",)


@dataclass
class RunningWorker:
    server: grpc.aio.Server
    port: int
    servicer: ExpertWorkerServicer
    health: health.aio.HealthServicer
    preload: asyncio.Task

    async def stop(self, grace: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        self.servicer.close()


async def start_worker(config: WorkerConfig, backend: ExpertBackend, device_uuid: str = "") -> RunningWorker:
    reader = CheckpointReader(config.model_dir)
    cfg = reader.config
    capacity = config.capacity or cfg.num_experts
    slots = SlotTable(reader, config.torch_dtype, torch.device(config.device), capacity)
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
    servicer = ExpertWorkerServicer(slots, backend, identity, config.shm_spin_us)
    server = grpc.aio.server(options=grpc_options(config.max_message_bytes))
    expert_worker_pb2_grpc.add_ExpertWorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        expert_worker_pb2.DESCRIPTOR.services_by_name["ExpertWorker"].full_name,
        reflection.SERVICE_NAME,
        health.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()

    async def preload() -> None:
        loop = asyncio.get_running_loop()
        n = await loop.run_in_executor(None, slots.preload, preload_ids)
        log.info("preloaded %d expert weights (%d per layer)", n, len(preload_ids))
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    return RunningWorker(server, port, servicer, health_servicer, asyncio.create_task(preload()))


def serve(config: WorkerConfig, backend: ExpertBackend, device_uuid: str = "") -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> int:
        w = await start_worker(config, backend, device_uuid)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"{config.kind} expert server listening on {config.host}:{w.port}", flush=True)
        done, _ = await asyncio.wait(
            [asyncio.ensure_future(stop.wait()), w.preload], return_when=asyncio.FIRST_COMPLETED
        )
        if w.preload in done and w.preload.exception() is not None:
            log.error("preloading experts failed: %s", w.preload.exception())
            await w.stop(0)
            return 1
        await stop.wait()
        await w.stop()
        return 0

    try:
        import uvloop

        return uvloop.run(main())
    except ImportError:
        return asyncio.run(main())
