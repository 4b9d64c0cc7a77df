"""The coordinator's own experts as a cluster member named ``local``.

The KTransformers-style hybrid (hot experts on the coordinator's GPU, the rest in CPU RAM) with
no second process on the GPU: :class:`LocalConnection` is the connection interface the cluster
(coordinator/experts/cluster.py) and the remote dispatcher (coordinator/experts/remote.py) talk
to, over an expert worker core (expertmesh/worker/core.py) in this process. Placement pushes,
adapter loads, checks and compute go through the same code as on an expert server, with no
gRPC, no encoding and no copy: the request's hidden states stay on the coordinator's device,
and the answer is a tensor there.

Backend: the GPU expert server's (Triton fused MoE, graphed at decode sizes; FP8 as stored) on
a CUDA coordinator, plain torch on a CPU one (that is how the CI tests it).

Overlap: the dispatcher sends a hybrid layer's CPU share first (the shared-memory ring), then
calls :meth:`LocalConnection.submit`, which launches the local share on the GPU's stream and
returns at once; the CPU server computes meanwhile, and the dispatcher sums both.

Shapes: T rows of the step, T_s rows of this member, H hidden, K top-k.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable

import torch

from coordinator.experts.cluster_config import ServerSpec
from coordinator.experts.expert_conn import ExpertServerError
from expertmesh import status
from expertmesh.checkpoint import CheckpointReader
from expertmesh.errors import ExpertMeshError, InvalidRequest
from expertmesh.experts import ExpertBackend, TorchExpertBackend
from expertmesh.lora.wire import decode_adapter
from expertmesh.net import device_uuid, host_id
from expertmesh.progress import LoadProgress
from expertmesh.transport import negotiate
from expertmesh.transport.errors import MalformedAnswer
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.server import slot_table
from expertmesh.worker_api import ExpertRequest, WorkerInfo

log = logging.getLogger("expertmesh.local")


def local_backend(device: torch.device, model_dir: str = "", cuda_graphs: bool = True) -> ExpertBackend:
    """The GPU expert server's backend on CUDA (gpu_server/main.py), plain torch elsewhere."""
    if device.type == "cuda":
        from gpu_server.main import backend_for  # NOTE: a CPU coordinator never loads Triton

        return backend_for(str(device), model_dir, cuda_graphs)
    return TorchExpertBackend()


class LocalReply:
    """An answer computed (or launched on the GPU's stream) when it was submitted."""

    def __init__(
        self, out: torch.Tensor | None, error: ExpertServerError | None, compute_ms: float | None
    ) -> None:
        self.out, self.error = out, error
        # the host time of a CPU computation; None on the GPU (launching is not computing), as
        # for fast-path answers: EPLB then weighs this member by the default speed
        self.compute_ms = compute_ms

    def result(self, timeout: float) -> torch.Tensor:  # [T_s, H] on the coordinator's device
        if self.error is not None:
            raise self.error
        assert self.out is not None
        return self.out

    def release(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class LocalConnection:
    """The in-process member: an expert worker core on the coordinator's device."""

    transport = "in-process"
    transport_note = "experts in the coordinator's own process"
    fast_fallbacks = 0
    link_note = "in process: no link needed"

    def __init__(
        self,
        spec: ServerSpec,
        reader: CheckpointReader,
        dtype: torch.dtype,
        device: torch.device,
        backend: ExpertBackend | None = None,
        max_loras: int = 4,
    ) -> None:
        if not spec.in_process:
            raise ValueError(f"{spec.name} is not the in-process member")
        self.spec, self.device = spec, device
        backend = backend or local_backend(device, str(reader.path))
        cfg = reader.config
        # NOTE: every expert of a layer at most once: a second copy here would share its bytes'
        # memory and speed, so it is no replica
        slots = slot_table(reader, backend, dtype, device, cfg.num_experts)
        identity = WorkerIdentity(
            kind=spec.kind,
            device=str(device),
            host_id=host_id(),
            device_uuid=device_uuid(device) if device.type == "cuda" else "",
        )
        self.worker = ExpertWorker(slots, backend, identity, max_loras)
        self.info: WorkerInfo | None = None
        self.dtype: torch.dtype | None = dtype
        self.slots_used = 0
        self.on_down: Callable[[ExpertServerError], None] = lambda err: None  # never called
        self._seq = itertools.count(1)
        self._closed = False
        self._timed = device.type == "cpu"  # the host's time is the compute time only here

    def describe_self(self) -> str:
        return f"the in-process experts ({self.spec.name})"

    def _error(self, e: ExpertMeshError) -> ExpertServerError:
        return ExpertServerError(status.grpc_code(e), f"{self.describe_self()}: {e.message}", e)

    def _call(self, fn: Callable[[], object], inference: bool = False) -> object:
        """A control-plane call (placement phases, adapters) on the cluster's or EPLB's thread.
        ``inference``: under inference mode, as the engine's steps are, for the adapter calls:
        the adapter buffers the worker makes while computing are inference tensors, which only
        inference mode may update in place. NOTE: never for the placement phases, whose reader
        threads fill the new slots outside it."""
        try:
            with torch.inference_mode() if inference else contextlib.nullcontext():
                return fn()
        except ExpertMeshError as e:
            raise self._error(e) from None

    # ------------------------------------------------------------ control plane

    def describe(self, timeout: float) -> WorkerInfo:
        self.info = self.worker.info()
        return self.info

    def plan_transport(self, info: WorkerInfo, local: negotiate.Side) -> None:
        pass  # NOTE: nothing travels: the request's tensors are the step's own

    def wait_serving(self, deadline: float) -> None:
        pass  # NOTE: ready when built; experts are read by the placement's PREPARE

    def serving(self, timeout: float) -> bool:
        return not self._closed

    def prepare(self, generation: int, table: dict[int, list[int]], timeout: float) -> None:
        t0 = time.monotonic()
        reader = self.worker.slots.reader
        total = reader.expert_nbytes() * sum(len(x) for x in table.values())
        reader.progress = LoadProgress(f"{self.spec.name} experts", total)
        try:
            n = self._call(lambda: self.worker.prepare(generation, table))
        finally:
            reader.progress.close()
            reader.progress = None
        self.slots_used = max((len(x) for x in table.values()), default=0)
        log.info(
            "%s: read %s experts (up to %d per layer) in %.1fs", self.spec.name, n, self.slots_used,
            time.monotonic() - t0,
        )  # fmt: skip

    def commit(self, generation: int, timeout: float) -> None:
        self._call(lambda: self.worker.commit(generation))

    def abort(self, generation: int, timeout: float) -> None:
        self._call(lambda: self.worker.abort(generation))

    def load_adapter(
        self, adapter_slot: int, name: str, tensors: dict, timeout: float, source: str = ""
    ) -> None:
        """The same decoding and checks as an expert server's LoadAdapter (the tensors come
        encoded as for the wire: one payload builder for every member)."""
        w = self.worker
        cfg = w.cfg
        try:
            layers = decode_adapter(
                tensors, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                w.slots.moe_layers, w.slots.dtype,
            )  # fmt: skip
        except ValueError as e:
            raise ExpertServerError.of(InvalidRequest(f"adapter {name!r}: {e}")) from None
        self._call(lambda: w.load_adapter(adapter_slot, name, layers), inference=True)

    def unload_adapter(self, name: str, timeout: float) -> None:
        self._call(lambda: self.worker.unload_adapter(name), inference=True)

    def lease(self, holder: str, ttl_s: float, timeout: float, release: bool = False, observe: bool = False):
        """Never asked: a coordinator with experts of its own shares no pool (ClusterConfig
        refuses ``--placement-lease`` with ``local``)."""
        raise ExpertServerError.of(InvalidRequest(f"{self.describe_self()} take part in no placement lease"))

    def live_placement(self, timeout: float) -> tuple[int, dict[int, list[int]]]:
        live = self.worker.slots.live
        return live.generation, {layer: list(ls.experts) for layer, ls in live.layers.items()}

    def expert_tokens(self, timeout: float) -> dict[int, list[int]]:
        return {layer: counts.tolist() for layer, counts in self.worker.tokens_per_expert.items()}

    # ------------------------------------------------------------ data plane

    def open_stream(self) -> LocalConnection:
        return self

    def stream_alive(self) -> bool:
        return not self._closed

    def retire_stream(self, reason: str, timeout: float) -> None:
        pass

    def reset(self, reason: str) -> None:
        pass

    def retarget(self, address: str) -> None:
        raise ValueError(f"{self.describe_self()} has no address to change (DNS names expert servers only)")

    def close(self) -> None:
        self._closed = True

    def next_seq(self) -> int:
        return next(self._seq)

    def stage(self, x: torch.Tensor, top_k: int) -> None:
        pass  # NOTE: the hidden states already are where this member computes

    def link(self) -> None:
        return None

    def submit(self, req: ExpertRequest) -> LocalReply:
        """Checks and computes ``req`` now, on the caller's thread: on the GPU the kernels are
        queued on the current stream (the step's) and this returns before they run."""
        x = req.gathered()  # [T_s, H], on this device
        mine = ExpertRequest(
            req.seq, req.generation, req.layer, x, req.slot_ids, req.weights, req.adapter_slots
        )
        t0 = time.perf_counter()
        try:
            out = self.worker.forward_built(mine)  # [T_s, H]
        except ExpertMeshError as e:
            return LocalReply(None, self._error(e), None)
        return LocalReply(out, None, (time.perf_counter() - t0) * 1e3 if self._timed else None)

    def bad_answer(self, layer: int, what: str, st: object = None) -> ExpertServerError:
        """An answer of the wrong shape (a backend bug): the layer fails over as for a server."""
        err = ExpertServerError.of(
            MalformedAnswer(f"{self.describe_self()} answered layer {layer} with a malformed output: {what}")
        )
        log.error("%s", err)
        return err


def connector(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device | str,
    max_loras: int = 4,
    backend: ExpertBackend | None = None,
) -> Callable[[ServerSpec], LocalConnection]:
    """What :class:`~coordinator.experts.cluster.ExpertCluster` calls to make the ``local``
    member (its own checkpoint reader: the cluster's thread reads experts while the
    coordinator serves)."""
    dev = torch.device(device)

    def make(spec: ServerSpec) -> LocalConnection:
        return LocalConnection(spec, CheckpointReader(model_dir), dtype, dev, backend, max_loras)

    return make


__all__ = ["LocalConnection", "LocalReply", "connector", "local_backend"]
