"""The coordinator's gRPC server: ``expertmesh.v1.Generation`` and ``expertmesh.v1.Admin``, plus
grpc.health.v1 and server reflection.

``create_server(config)`` loads the model, builds the engine and scheduler and registers the
services; the caller binds a port (``add_insecure_port``, 0 = a free one), ``start()``s it and
eventually ``stop()``s it, which also stops the scheduler thread and the expert connections.

Health is NOT_SERVING until every expert server of the placement is connected and has
acknowledged it (at once with in-process experts); while it is not, Generate answers
UNAVAILABLE and a background task keeps reconnecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.config import DTYPES, CoordinatorConfig, parse_size
from coordinator.eplb.degraded import DegradedPlacement
from coordinator.eplb.drain import LeavingPlacement
from coordinator.eplb.manager import EplbManager, RebalanceError
from coordinator.eplb.target import ClusterTarget
from coordinator.experts.cluster import ExpertCluster
from coordinator.experts.expert_conn import ExpertServerError
from coordinator.experts.load_recorder import LoadRecorder
from coordinator.experts.local import connector
from coordinator.experts.remote import RemoteDispatcher
from coordinator.lora import AdapterError, LoRAAdapter, enable_lora
from coordinator.lora.service import LoRANotFound, LoRAPermissionError, LoRAPushError, LoRAService
from coordinator.model import compile_ahead
from coordinator.model.dispatch import Dispatcher, LocalDispatcher
from coordinator.model.engine import Engine
from coordinator.model.kv_cache import KVCacheSpec
from coordinator.model.loader import load_model
from coordinator.serving import eplb_admin
from coordinator.serving.chat import ChatTemplate
from coordinator.serving.metrics import CoordinatorMetrics
from coordinator.serving.outputs import error_status
from coordinator.serving.requests import (
    InvalidRequest,
    RequestLimits,
    add_generation_servicer,
    parse_request_async,
)
from coordinator.serving.scheduler import (
    Output,
    QueueFull,
    Scheduler,
    SchedulerLimits,
    SchedulerStopped,
)
from coordinator.serving.status import add_status
from coordinator.serving.tokenizer import TextTokenizer
from expertmesh import auth, cores, status, tls, tolerant
from expertmesh import placement as pl
from expertmesh.checkpoint import CheckpointReader
from expertmesh.errors import ExpertMeshError
from expertmesh.health import LIVENESS
from expertmesh.net import grpc_options
from expertmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

if TYPE_CHECKING:
    from coordinator.serving.http.server import HttpServer

__all__ = ["DTYPES", "CoordinatorConfig", "CoordinatorServer", "create_server", "parse_size"]

log = logging.getLogger("expertmesh.coordinator")

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


_FINISH = {
    "stop": generation_pb2.STOP,
    "length": generation_pb2.LENGTH,
    "cancelled": generation_pb2.CANCELLED,
    "error": generation_pb2.ERROR,
}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, coord: CoordinatorServer) -> None:
        self.coord = coord

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        c = self.coord
        try:
            ids, params = await parse_request_async(request, c.request_limits, c.tokenizer, c.lora.usable)
        except InvalidRequest as e:
            c.metrics.invalid()  # expertmesh_requests_total{status="invalid"}
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not c.experts_ready:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"expert servers are not ready: {c.expert_state()}"
            )
        outputs: asyncio.Queue[Output] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(out: Output) -> None:  # scheduler thread
            with contextlib.suppress(RuntimeError):  # the event loop closed under a shutdown
                loop.call_soon_threadsafe(outputs.put_nowait, out)

        try:
            deadline = c.deadline(context.time_remaining())  # the client's gRPC deadline
            rid = c.scheduler.submit(ids, params, sink, lora=request.lora or None, deadline=deadline)
        except (SchedulerStopped, QueueFull) as e:
            await context.abort(*error_status(e))
        request_id = request.request_id or f"req-{rid}"
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finish_reason is not None
                if out.error is not None:
                    code, msg = error_status(out.error)
                    await context.abort(code, msg)
                resp = generation_pb2.GenerateResponse(
                    token_ids=out.token_ids,
                    text=out.text,
                    logprobs=out.logprobs,
                    request_id=request_id,
                    prompt_logprobs=out.prompt_logprobs or (),
                )
                if finished:
                    resp.finish_reason = _FINISH[out.finish_reason]  # type: ignore[index]
                    resp.usage.prompt_tokens = out.prompt_tokens
                    resp.usage.completion_tokens = out.completion_tokens
                    resp.usage.cached_tokens = out.cached_tokens
                yield resp
        finally:
            if not finished:  # the client went away: free the request's pages
                c.scheduler.cancel(rid)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Admin: with an admin token every call must carry it; without one, loopback peers only."""

    def __init__(self, coord: CoordinatorServer) -> None:
        self.coord = coord

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        token = self.coord.config.admin_token
        try:
            if token:
                auth.check_token(token, context.invocation_metadata(), "Admin")
            else:
                auth.check_local(context.peer(), "Admin")
        except ExpertMeshError as e:
            await context.abort(status.grpc_code(e), e.message)

    async def ListServers(self, request, context) -> admin_pb2.ListServersResponse:
        await self._authorize(context)
        cluster = self.coord.cluster
        infos = cluster.server_infos() if cluster is not None else []
        fields = set(admin_pb2.ServerInfo.DESCRIPTOR.fields_by_name)
        resp = admin_pb2.ListServersResponse(
            servers=[admin_pb2.ServerInfo(**{k: v for k, v in i.items() if k in fields}) for i in infos]
        )
        add_status(self.coord, resp)  # round trips and coordinator stats (fields 140+)
        return resp

    async def GetPlacement(self, request, context) -> admin_pb2.PlacementInfo:
        await self._authorize(context)
        cluster = self.coord.cluster
        if cluster is None:
            return admin_pb2.PlacementInfo()
        p = cluster.placement
        pool = cluster.pool
        return admin_pb2.PlacementInfo(
            coordinator_id=pool.id if pool is not None else "",
            placement_holder=pool.seen_holder if pool is not None else "",
            generation=p.generation,
            servers=list(p.servers),
            layers=[
                admin_pb2.LayerPlacement(
                    layer=layer, phy2log=lp.phy2log, owner=lp.owner, local_slot=lp.local_slot
                )
                for layer, lp in sorted(p.layers.items())
            ],
        )

    async def GetExpertLoad(self, request, context) -> admin_pb2.ExpertLoad:
        await self._authorize(context)
        snap = await asyncio.to_thread(self.coord.load.snapshot)
        cluster = self.coord.cluster
        return eplb_admin.load_pb(snap, cluster.placement if cluster is not None else None)

    # ---------------------------------------------------------------- EPLB

    def _eplb(self) -> EplbManager:
        m = self.coord.eplb
        if m is None:
            raise _AdminError(
                grpc.StatusCode.FAILED_PRECONDITION, "no expert servers: every expert runs in process"
            )
        return m

    async def Rebalance(self, request, context) -> admin_pb2.RebalanceResponse:
        await self._authorize(context)
        try:
            out = await asyncio.to_thread(self._eplb().rebalance, request.dry_run)
        except (_AdminError, RebalanceError) as e:
            await _abort(context, e)
        return admin_pb2.RebalanceResponse(outcome=eplb_admin.outcome_pb(out))

    async def SetPlacement(self, request, context) -> admin_pb2.SetPlacementResponse:
        await self._authorize(context)
        try:
            m = self._eplb()
            live = m.target.live_placement()
            layers = self.coord.scheduler.engine.config.moe_layer_ids
            new = pl.parse_json(request.placement_json, layers, live.num_experts, live.servers)
            # NOTE: checked before any push: a server refusing it would be marked down for it
            pl.check_capacity(new, m.target.slot_capacity().tolist())
            out = await asyncio.to_thread(m.set_placement, new)
        except pl.PlacementError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ExpertServerError as e:  # a server not described yet: its capacity is unknown
            await context.abort(e.code, str(e))
        except (_AdminError, RebalanceError) as e:
            await _abort(context, e)
        if out.kind == "failed":
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"placement not applied, the old one stays: {out.error}"
            )
        return admin_pb2.SetPlacementResponse(generation=out.generation)

    async def GetEplbStatus(self, request, context) -> admin_pb2.EplbStatus:
        await self._authorize(context)
        try:
            m = self._eplb()
        except _AdminError as e:
            await _abort(context, e)
        policy = self.coord.config.cluster.replica_policy if self.coord.config.cluster else ""
        return eplb_admin.status_pb(m, policy)

    # ------------------------------------------------------------------ MoE LoRA

    async def LoadLoRA(self, request, context) -> admin_pb2.LoRAInfo:
        await self._authorize(context)
        service = self.coord.lora
        try:
            adapter = await asyncio.to_thread(service.load, request.name, request.path)
        except _LORA_ERRORS as e:
            await _lora_abort(context, e)
        return _lora_info(adapter, service.manager.slot_of[adapter.name])

    async def UnloadLoRA(self, request, context) -> admin_pb2.UnloadLoRAResponse:
        await self._authorize(context)
        try:
            await asyncio.to_thread(self.coord.lora.unload, request.name)
        except _LORA_ERRORS as e:
            await _lora_abort(context, e)
        return admin_pb2.UnloadLoRAResponse()

    async def ListLoRA(self, request, context) -> admin_pb2.ListLoRAResponse:
        await self._authorize(context)
        service = self.coord.lora
        return admin_pb2.ListLoRAResponse(
            adapters=[_lora_info(a, service.manager.slot_of[a.name]) for a in service.list()],
            max_loras=service.manager.max_loras,
        )


class _AdminError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _abort(context, e: Exception) -> None:
    code = e.code if isinstance(e, _AdminError) else grpc.StatusCode.ABORTED
    await context.abort(code, str(e))


_LORA_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (LoRAPermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (LoRANotFound, grpc.StatusCode.NOT_FOUND),
    (AdapterError, grpc.StatusCode.INVALID_ARGUMENT),
    (LoRAPushError, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


_LORA_ERRORS = tuple(kind for kind, _ in _LORA_CODES)


async def _lora_abort(context: grpc.aio.ServicerContext, e: BaseException) -> None:
    code = next(code for kind, code in _LORA_CODES if isinstance(e, kind))
    await context.abort(code, e.args[0] if e.args else str(e))


def _lora_info(a: LoRAAdapter, slot: int) -> admin_pb2.LoRAInfo:
    return admin_pb2.LoRAInfo(
        name=a.name,
        path=a.path,
        adapter_slot=slot,
        max_rank=a.max_rank,
        expert_layers=sorted(a.experts),
        modules=sorted(a.projections),
    )


# ---------------------------------------------------------------------- the server


class CoordinatorServer(grpc.aio.Server):
    """A grpc.aio.Server whose start/stop also run the scheduler and the expert connections."""

    def __init__(
        self,
        config: CoordinatorConfig,
        server: grpc.aio.Server,
        scheduler: Scheduler,
        dispatcher: Dispatcher,
        tokenizer: TextTokenizer | None,
        load: LoadRecorder,
        cluster: ExpertCluster | None = None,
        eplb: EplbManager | None = None,
    ) -> None:
        self.config, self.server, self.scheduler, self.dispatcher = config, server, scheduler, dispatcher
        self.tokenizer, self.load, self.eplb = tokenizer, load, eplb
        self.cluster = cluster  # None: every expert in process
        self.health = health.aio.HealthServicer()
        self.experts_ready = cluster is None  # requests are admitted (see _watch_experts)
        self._covered = cluster is None
        self.draining = False  # SIGTERM: admit nothing new, finish what runs
        # MoE LoRA: adapter registry + hot-load (coordinator/lora); the engine gets its hooks
        manager = enable_lora(scheduler.engine, config.max_loras)
        self.lora = LoRAService(
            manager,
            config.lora_dirs,
            scheduler.call_between_steps,
            lambda name: int(scheduler.call_between_steps(lambda: scheduler.uses_adapter(name)).result()),
            cluster,
            timeout_s=config.cluster.timeout_s if config.cluster is not None else 60.0,
        )
        self._watch: asyncio.Task | None = None
        # Prometheus metrics, chat template and the HTTP server (coordinator/serving/http)
        self.metrics = CoordinatorMetrics(self)
        self.chat_template = ChatTemplate.from_dir(config.model_dir)
        self.http: HttpServer | None = None
        cfg = scheduler.engine.config
        self.request_limits = RequestLimits(
            cfg.vocab_size, scheduler.limits.max_context, config.default_max_new_tokens, config.input_limits
        )
        add_generation_servicer(GenerationServicer(self), server)  # INVALID_ARGUMENT for non-UTF-8
        # malformed request bytes -> INVALID_ARGUMENT, not UNKNOWN
        tolerant.add_service(AdminServicer(self), server, admin_pb2.DESCRIPTOR.services_by_name["Admin"])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (GENERATION, ADMIN, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )

    def deadline(self, remaining_s: float | None) -> float | None:
        """A request's ``time.monotonic()`` deadline: the client's (seconds left, None = none),
        capped by ``--request-timeout``."""
        timeout = self.config.request_timeout_s
        if remaining_s is None or (timeout is not None and timeout < remaining_s):
            remaining_s = timeout
        return None if remaining_s is None else time.monotonic() + remaining_s

    def expert_state(self) -> str:
        if self.draining:  # what refused requests read
            return "the coordinator is draining (shutting down)"
        return "in process" if self.cluster is None else self.cluster.describe_state()

    def serving(self) -> bool:
        """What both health surfaces answer (grpc.health.v1 and HTTP ``/health``): not draining,
        and every expert has a live server (a request may need any of them)."""
        return self._covered and not self.draining

    async def set_health(self) -> None:
        """Publishes :meth:`serving` to the gRPC health service (HTTP reads it per request)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.serving()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", GENERATION, ADMIN):
            await self.health.set(name, status)

    async def _watch_experts(self, cluster: ExpertCluster) -> None:
        """Keeps health in step with the expert servers (the cluster's own thread connects and
        reconnects them)."""
        cluster.start(self.config.connect_timeout_s)
        while True:
            # NOTE: health is SERVING while every expert has a live server (a down replica is
            # routed around); requests are admitted while some server is live (those
            # that need a lost expert fail at its layer, naming it; the others go on)
            covered = cluster.covered()
            ready = covered or cluster.serving_some()
            if covered != self._covered:
                log.info("expert servers %s", "ready" if covered else f"not ready: {self.expert_state()}")
            self._covered = covered
            self.experts_ready = ready and not self.draining
            await self.set_health()
            await asyncio.sleep(1.0 if covered else 0.2)

    # grpc.aio.Server

    def add_generic_rpc_handlers(self, generic_rpc_handlers) -> None:
        self.server.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        self.server.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self.server.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self.server.add_secure_port(address, server_credentials)

    def add_port(self, address: str) -> int:
        """TLS when the config has a certificate (--tls-cert), plaintext otherwise."""
        return tls.add_port(self.server, address, self.config.tls)

    async def start(self) -> None:
        await self.set_health()
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        self.scheduler.start()
        await self.server.start()
        if self.config.http_port is not None:
            # NOTE: imported here: the HTTP stack (FastAPI, Starlette, pydantic, uvicorn) is a
            # quarter of the serving imports, which a coordinator without HTTP need not wait for
            from coordinator.serving.http.server import start_http

            self.http = await start_http(self, self.config.host, self.config.http_port)
        if self.cluster is not None:
            self._watch = asyncio.create_task(self._watch_experts(self.cluster))
            self._watch.add_done_callback(_report_crash)

    async def stop(self, grace: float | None) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace)
        await asyncio.to_thread(self.scheduler.stop)
        await asyncio.to_thread(self.dispatcher.close)  # joins the cluster's thread

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.server.wait_for_termination(timeout)


def _report_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the expert-server watcher died: %r", task.exception())


def create_server(config: CoordinatorConfig) -> CoordinatorServer:
    """Loads the model and builds the server (call inside the event loop that will run it)."""
    cores.cap_default_executor()  # asyncio.to_thread's pool, sized from this process's cores
    reader = CheckpointReader(config.model_dir)
    cfg, dtype, device = reader.config, config.torch_dtype, torch.device(config.device)
    spec = KVCacheSpec.from_budget(cfg, config.kv_memory_bytes, config.page_size, dtype)
    capacity = spec.num_pages * spec.page_size
    if config.max_context is not None and config.max_context > capacity:
        raise ValueError(
            f"max context {config.max_context} tokens does not fit the KV cache ({spec.num_pages} pages of "
            f"{spec.page_size} = {capacity} tokens): raise the KV memory budget or lower the max context"
        )
    max_context = min(config.max_context or cfg.max_position_embeddings, capacity)
    model = load_model(reader, dtype, device)
    if config.cluster is not None and config.cluster.servers:
        # NOTE: dns:/// servers become one server per address before anything counts servers;
        # after the weights load, so that servers started alongside have their addresses by now
        config = replace(config, cluster=config.cluster.resolved())
    dispatcher: Dispatcher
    cluster: ExpertCluster | None = None
    if config.cluster is not None and config.cluster.servers:
        local = (
            connector(config.model_dir, dtype, device, config.max_loras) if config.cluster.has_local else None
        )
        cluster = ExpertCluster(cfg, config.cluster, device, local=local)
        dispatcher = RemoteDispatcher(cfg, config.cluster, dtype, device, cluster)
    else:
        # on CUDA the experts load while the engine compiles its kernels (LocalDispatcher.load)
        dispatcher = LocalDispatcher(reader, dtype, device, background=device.type == "cuda")
    num_servers = len(config.cluster.servers) if cluster is not None and config.cluster else 0
    load = LoadRecorder(cfg.moe_layer_ids, cfg.num_experts, config.eplb.window_steps, num_servers, device)
    # NOTE: the decode graphs' warm-up takes each bucket's kernels from the compile helper,
    # where one runs (coordinator/model/compile_ahead.py)
    engine = Engine(
        model,
        dispatcher,
        spec,
        dtype,
        device,
        load_hook=load.record,
        prefix_cache=config.prefix_cache,
        step_load=load.record_step,
    )
    compile_ahead.wait()  # ended by now: reaped, and its time logged
    engine.micro_batches = config.micro_batches
    if isinstance(dispatcher, LocalDispatcher):
        dispatcher.wait_loaded()  # a failed read fails the start, before anything serves
    tokenizer = TextTokenizer.from_dir(config.model_dir)
    limits = SchedulerLimits(
        config.max_batch_tokens,
        config.max_running,
        max_context,
        config.max_queued_requests,
        config.max_queued_tokens,
    )
    scheduler = Scheduler(engine, limits, tokenizer, cfg.eos_token_ids)
    scheduler.overlap = scheduler.overlap and config.step_overlap
    eplb: EplbManager | None = None
    if cluster is not None:
        assert config.cluster is not None
        expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype.itemsize
        target = ClusterTarget(cluster, config.cluster.timeout_s, stopped=(SchedulerStopped,))
        eplb = EplbManager(config.eplb, load, target, expert_bytes, scheduler.call_between_steps)
        engine.after_step = eplb.on_step
        assert isinstance(dispatcher, RemoteDispatcher)
        dispatcher.server_time_hook = load.record_server_time
    if cluster is not None:  # placement commits (and renumbering) land between two steps
        cluster.between_steps = scheduler.call_between_steps
        assert config.cluster is not None
        LeavingPlacement(cluster, config.cluster.timeout_s)  # a drained server's experts re-placed
        if config.degraded_replace_after_s is not None:  # opt-in re-placement
            assert config.cluster is not None
            DegradedPlacement(cluster, config.degraded_replace_after_s, config.cluster.timeout_s)
    log.info(
        "KV cache: %d pages of %d tokens (%d tokens), max context %d, tokenizer %s",
        spec.num_pages,
        spec.page_size,
        capacity,
        max_context,
        "yes" if tokenizer else "none (input_ids only)",
    )
    server = grpc.aio.server(options=grpc_options(config.max_message_mb << 20))
    return CoordinatorServer(config, server, scheduler, dispatcher, tokenizer, load, cluster, eplb)
