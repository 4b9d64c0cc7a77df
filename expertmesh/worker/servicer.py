"""The ``expertmesh.v1.ExpertWorker`` servicer: validation at the boundary, compute serialised
(one request at a time, in arrival order, and a placement commit never lands in the middle of
a request), typed errors mapped to gRPC status codes.

A ``Forward`` stream whose first message is a fast-path handshake also gets a shared-memory
channel (expertmesh.transport.server): its requests come through the channel's thread and are
validated and computed by the same :meth:`check` and :meth:`compute` as gRPC messages.

Shapes: T tokens, K top-k, H hidden, S local slots.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from expertmesh import wire
from expertmesh.experts import ExpertBackend
from expertmesh.metrics import WorkerMetrics
from expertmesh.transport.errors import Rejected
from expertmesh.transport.handshake import Ack, HandshakeError, Hello
from expertmesh.transport.server import FastRequest, ShmServer
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.worker.slots import SlotError, SlotTable

MAX_TOP_K = 64
INLINE_MAX_TOKENS = 16  # requests this small skip the compute thread (see _run)


class RequestError(Rejected):
    """A request refused with ``code`` (a grpc.StatusCode) and ``message``."""


def _bad(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class WorkerIdentity:
    kind: str  # "gpu" | "cpu"
    device: str
    host_id: str
    device_uuid: str = ""
    fast_paths: tuple[str, ...] = ()
    max_message_bytes: int = 0


@dataclass
class WorkerStats:
    requests: int = 0
    tokens: int = 0
    errors: int = 0
    compute_seconds: float = 0.0


@dataclass(frozen=True)
class ForwardArgs:
    seq: int
    layer: int
    hidden: torch.Tensor  # [T, H]
    slot_ids: torch.Tensor  # [T, K] int32
    weights: torch.Tensor  # [T, K] float32


class ExpertWorkerServicer(pb_grpc.ExpertWorkerServicer):
    def __init__(
        self, slots: SlotTable, backend: ExpertBackend, identity: WorkerIdentity, shm_spin_us: float = 300.0
    ) -> None:
        self.slots, self.backend, self.identity = slots, backend, identity
        self.shm_spin_us = shm_spin_us
        self.cfg = slots.reader.config
        self.stats = WorkerStats()
        self.metrics = WorkerMetrics(self)  # issue 16: Prometheus /metrics (--metrics-port)
        self.tokens_per_slot: dict[int, np.ndarray] = {}  # layer -> [S] tokens routed to each slot
        # NOTE: one compute thread for gRPC requests and commits; fast-path channel threads
        # compute too, so compute and commit also hold this lock.
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="expert-compute")
        self._serial = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="expert-load")

    # ------------------------------------------------------------ validation

    def validate(self, req: pb.ForwardRequest) -> ForwardArgs:
        if req.fast_path:
            raise _bad("a fast-path handshake must be the first message of a stream (seq 0)")
        try:
            x = wire.decode(req.hidden, "hidden")
            slot_ids = wire.decode(req.slot_ids, "slot_ids")
            weights = wire.decode(req.weights, "weights")
        except wire.WireError as e:
            raise _bad(str(e)) from None
        return self.check(req.seq, req.layer, req.generation, x, slot_ids, weights)

    def check(
        self,
        seq: int,
        layer: int,
        generation: int,
        x: torch.Tensor,  # [T, H]
        slot_ids: torch.Tensor,  # [T, K]
        weights: torch.Tensor,  # [T, K]
    ) -> ForwardArgs:
        """The checks of a decoded request, whichever path it came by."""
        live = self.slots.live
        if layer not in live.layers:
            raise _bad(
                f"layer {layer} is not an MoE layer of this model (MoE layers: {self.slots.moe_layers})"
            )
        if generation != live.generation:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"placement generation {generation} is not the live generation {live.generation}",
            )
        h = self.cfg.hidden_size
        if x.dtype != self.slots.dtype:
            raise _bad(
                f"hidden has dtype {wire.dtype_name(x.dtype)}, this server computes in {wire.dtype_name(self.slots.dtype)}"
            )
        if x.dim() != 2 or x.shape[1] != h:
            raise _bad(f"hidden has shape {list(x.shape)}, expected [T, {h}]")
        t = x.shape[0]
        if slot_ids.dtype != torch.int32 or slot_ids.dim() != 2 or slot_ids.shape[0] != t:
            raise _bad(
                f"slot_ids must be int32 [{t}, K], got {wire.dtype_name(slot_ids.dtype)} {list(slot_ids.shape)}"
            )
        k = slot_ids.shape[1]
        if not 0 < k <= MAX_TOP_K:
            raise _bad(f"top-k {k} outside [1, {MAX_TOP_K}]")
        if weights.dtype != torch.float32 or tuple(weights.shape) != (t, k):
            raise _bad(
                f"weights must be float32 [{t}, {k}], got {wire.dtype_name(weights.dtype)} {list(weights.shape)}"
            )
        n_slots = len(live.layers[layer].experts)
        if t:
            lo, hi = (int(v) for v in torch.aminmax(slot_ids))
            if lo < -1 or hi >= n_slots:
                raise _bad(
                    f"slot ids must be -1 or in [0, {n_slots}) for layer {layer}; got range [{lo}, {hi}]"
                )
        if t and not bool(np.isfinite(weights.numpy()).all()):
            raise _bad("weights contain NaN or infinity")
        return ForwardArgs(seq, layer, x, slot_ids, weights)

    # ------------------------------------------------------------ compute

    def compute(self, args: ForwardArgs, generation: int, to_host: bool = True) -> torch.Tensor:
        """``[T, H]`` on the host, or on the server's device (``to_host=False``: the fast paths
        copy it where the coordinator reads it)."""
        with self._serial:
            return self._compute_locked(args, generation, to_host)

    def _compute_locked(self, args: ForwardArgs, generation: int, to_host: bool) -> torch.Tensor:
        live = self.slots.live
        if live.generation != generation:  # a commit ran between validation and compute
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"placement generation {generation} was replaced by {live.generation}",
            )
        layer = live.layers[args.layer]
        t0 = time.perf_counter()
        dev = self.slots.device
        out = self.backend.forward(
            args.hidden.to(dev, non_blocking=True),
            layer.w13,
            layer.w2,
            args.slot_ids.to(dev, non_blocking=True),
            args.weights.to(dev, non_blocking=True),
        )
        if to_host:
            out = out.cpu()
        dt = time.perf_counter() - t0
        self.stats.compute_seconds += dt
        self.metrics.compute(args.layer, dt)
        self.stats.requests += 1
        self.stats.tokens += args.hidden.shape[0]
        # NOTE: numpy: on these few numbers its ops cost a fraction of torch's per-op overhead
        ids = args.slot_ids.numpy().ravel()  # [T * K]
        counts = np.bincount(ids[ids >= 0], minlength=len(layer.experts))  # [S]
        prev = self.tokens_per_slot.get(args.layer)
        if prev is None or prev.shape != counts.shape:
            self.tokens_per_slot[args.layer] = counts
        else:
            prev += counts
        return out

    # ------------------------------------------------------------ RPCs

    async def Describe(self, request, context):
        cfg, ident = self.cfg, self.identity
        return pb.DescribeResponse(
            kind=ident.kind,
            device=ident.device,
            dtype=wire.dtype_name(self.slots.dtype),
            backend=self.backend.name,
            model_type=cfg.model_type,
            hidden_size=cfg.hidden_size,
            num_experts=cfg.num_experts,
            moe_layers=self.slots.moe_layers,
            slot_capacity=self.slots.capacity,
            host_id=ident.host_id,
            fast_paths=list(ident.fast_paths),
            generation=self.slots.live.generation,
            device_uuid=ident.device_uuid,
            max_message_bytes=ident.max_message_bytes,
        )

    async def Forward(
        self, request_iterator: AsyncIterator[pb.ForwardRequest], context
    ) -> AsyncIterator[pb.ForwardResponse]:
        loop = asyncio.get_running_loop()
        fast: ShmServer | None = None
        try:
            async for req in request_iterator:
                try:
                    if req.fast_path and req.seq == 0 and fast is None:
                        fast, ack = await self._open_fast_path(req.fast_path)
                        yield pb.ForwardResponse(seq=0, fast_path=ack.encode())
                        continue
                    args = self.validate(req)
                    t0 = time.perf_counter()
                    out = await self._run(loop, args, req.generation)
                except RequestError as e:
                    self.stats.errors += 1
                    self.metrics.reject(e.code)
                    await context.abort(e.code, e.message)
                    return
                yield pb.ForwardResponse(
                    seq=req.seq, output=wire.encode(out), compute_ms=(time.perf_counter() - t0) * 1e3
                )
        finally:
            if fast is not None:
                fast.close()

    async def _run(self, loop: asyncio.AbstractEventLoop, args: ForwardArgs, generation: int) -> torch.Tensor:
        # NOTE: decode-sized requests run right here when nobody else is computing: the hop to
        # the compute thread and back costs ~0.4 ms on a loaded host, more than their compute
        # (benchmarks/RESULTS.md, issue 3). Never wait for the lock on the event loop.
        if args.hidden.shape[0] <= INLINE_MAX_TOKENS and self._serial.acquire(blocking=False):
            try:
                return self._compute_locked(args, generation, True)
            finally:
                self._serial.release()
        return await loop.run_in_executor(self._compute, self.compute, args, generation)

    # ------------------------------------------------------------ fast paths

    async def _open_fast_path(self, raw: bytes) -> tuple[ShmServer | None, Ack]:
        try:
            hello = Hello.decode(raw)
        except HandshakeError as e:
            raise _bad(str(e)) from None
        if "shm" not in self.identity.fast_paths:
            return None, Ack("grpc", "this server offers no shared-memory fast path (--no-shm)")
        fast = ShmServer(hello, self.slots.device, self.fast_forward, self._count_error, self.shm_spin_us)
        ack = await asyncio.wrap_future(fast.start())
        return (fast if ack.transport != "grpc" else None), ack

    def fast_forward(self, r: FastRequest) -> torch.Tensor:
        """One fast-path request (on its channel's thread): the gRPC path's checks and compute."""
        try:
            args = self.check(r.seq, r.layer, r.generation, r.hidden, r.slot_ids, r.weights)
            return self.compute(args, r.generation, to_host=False)
        except RequestError as e:
            self._count_error()
            self.metrics.reject(e.code)
            raise

    def _count_error(self) -> None:
        self.stats.errors += 1

    async def ApplyPlacement(self, request, context):
        loop = asyncio.get_running_loop()
        phase, gen = request.phase, request.generation
        try:
            if phase == pb.ApplyPlacementRequest.PREPARE:
                table = {ls.layer: list(ls.experts) for ls in request.layers}
                for layer, experts in table.items():
                    bad = [e for e in experts if not 0 <= e < self.cfg.num_experts]
                    if bad:
                        raise SlotError(f"layer {layer}: experts {bad} outside [0, {self.cfg.num_experts})")
                read = await loop.run_in_executor(self._loader, self.slots.prepare, gen, table)
                return pb.ApplyPlacementResponse(generation=self.slots.live.generation, experts_loaded=read)
            if phase == pb.ApplyPlacementRequest.COMMIT:
                await loop.run_in_executor(self._compute, self._commit, gen)
            elif phase == pb.ApplyPlacementRequest.ABORT:
                self.slots.abort(gen)
            else:
                raise SlotError("phase must be PREPARE, COMMIT or ABORT")
        except SlotError as e:
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if "generation" in str(e)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(e))
        return pb.ApplyPlacementResponse(generation=self.slots.live.generation)

    def _commit(self, generation: int) -> None:
        with self._serial:
            self.slots.commit(generation)

    async def LoadAdapter(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "MoE LoRA adapters are not implemented yet")

    async def UnloadAdapter(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "MoE LoRA adapters are not implemented yet")

    async def Stats(self, request, context):
        s = self.stats
        layers = [
            pb.LayerStats(layer=layer, tokens_per_slot=c.tolist())
            for layer, c in sorted(self.tokens_per_slot.items())
        ]
        return pb.StatsResponse(
            requests=s.requests,
            tokens=s.tokens,
            errors=s.errors,
            compute_seconds=s.compute_seconds,
            layers=layers,
            generation=self.slots.live.generation,
        )

    def close(self) -> None:
        self._compute.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)
