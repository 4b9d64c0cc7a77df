"""The ``expertmesh.v1.ExpertWorker`` servicer: validation at the boundary, compute in a
single worker thread (so requests run in arrival order and a placement commit never lands in
the middle of a request), typed errors mapped to gRPC status codes.

Shapes: T tokens, K top-k, H hidden, S local slots.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from expertmesh import wire
from expertmesh.experts import ExpertBackend
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.worker.slots import SlotError, SlotTable

MAX_TOP_K = 64


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


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
    def __init__(self, slots: SlotTable, backend: ExpertBackend, identity: WorkerIdentity) -> None:
        self.slots, self.backend, self.identity = slots, backend, identity
        self.cfg = slots.reader.config
        self.stats = WorkerStats()
        self.tokens_per_slot: dict[int, torch.Tensor] = {}
        # NOTE: one compute thread: requests and commits are serialised through it.
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="expert-compute")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="expert-load")

    # ------------------------------------------------------------ validation

    def validate(self, req: pb.ForwardRequest) -> ForwardArgs:
        live = self.slots.live
        if req.layer not in live.layers:
            raise _bad(
                f"layer {req.layer} is not an MoE layer of this model (MoE layers: {self.slots.moe_layers})"
            )
        if req.generation != live.generation:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"placement generation {req.generation} is not the live generation {live.generation}",
            )
        try:
            x = wire.decode(req.hidden, "hidden")
            slot_ids = wire.decode(req.slot_ids, "slot_ids")
            weights = wire.decode(req.weights, "weights")
        except wire.WireError as e:
            raise _bad(str(e)) from None
        h = self.cfg.hidden_size
        if x.dtype != self.slots.dtype:
            raise _bad(
                f"hidden has dtype {req.hidden.dtype}, this server computes in {wire.dtype_name(self.slots.dtype)}"
            )
        if x.dim() != 2 or x.shape[1] != h:
            raise _bad(f"hidden has shape {list(x.shape)}, expected [T, {h}]")
        t = x.shape[0]
        if slot_ids.dtype != torch.int32 or slot_ids.dim() != 2 or slot_ids.shape[0] != t:
            raise _bad(f"slot_ids must be int32 [{t}, K], got {req.slot_ids.dtype} {list(slot_ids.shape)}")
        k = slot_ids.shape[1]
        if not 0 < k <= MAX_TOP_K:
            raise _bad(f"top-k {k} outside [1, {MAX_TOP_K}]")
        if weights.dtype != torch.float32 or tuple(weights.shape) != (t, k):
            raise _bad(f"weights must be float32 [{t}, {k}], got {req.weights.dtype} {list(weights.shape)}")
        n_slots = len(live.layers[req.layer].experts)
        if t and (int(slot_ids.min()) < -1 or int(slot_ids.max()) >= n_slots):
            raise _bad(
                f"slot ids must be -1 or in [0, {n_slots}) for layer {req.layer}; "
                f"got range [{int(slot_ids.min())}, {int(slot_ids.max())}]"
            )
        if t and not bool(torch.isfinite(weights).all()):
            raise _bad("weights contain NaN or infinity")
        return ForwardArgs(req.seq, req.layer, x, slot_ids, weights)

    # ------------------------------------------------------------ compute

    def compute(self, args: ForwardArgs, generation: int) -> torch.Tensor:
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
            args.hidden.to(dev), layer.w13, layer.w2, args.slot_ids.to(dev), args.weights.to(dev)
        )
        out = out.cpu()
        self.stats.compute_seconds += time.perf_counter() - t0
        self.stats.requests += 1
        self.stats.tokens += args.hidden.shape[0]
        used = args.slot_ids[args.slot_ids >= 0].long()
        counts = torch.bincount(used, minlength=len(layer.experts))
        prev = self.tokens_per_slot.get(args.layer)
        self.tokens_per_slot[args.layer] = (
            counts if prev is None or prev.shape != counts.shape else prev + counts
        )
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
        async for req in request_iterator:
            try:
                args = self.validate(req)
                t0 = time.perf_counter()
                out = await loop.run_in_executor(self._compute, self.compute, args, req.generation)
            except RequestError as e:
                self.stats.errors += 1
                await context.abort(e.code, e.message)
                return
            yield pb.ForwardResponse(
                seq=req.seq, output=wire.encode(out), compute_ms=(time.perf_counter() - t0) * 1e3
            )

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
                await loop.run_in_executor(self._compute, self.slots.commit, gen)
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
