"""The expert worker core: slot table + backend + stats, without gRPC.

:class:`ExpertWorker` checks an :class:`~expertmesh.worker_api.ExpertRequest` (whichever
transport it came by), computes it (one request at a time, and a placement commit never lands
in the middle of one), counts load, and runs the two placement phases. It raises typed errors
(:mod:`expertmesh.errors`); the gRPC servicer (servicer.py) and the fast-path server
(expertmesh/transport/server.py) are thin adapters around it.

Shapes: T tokens, K top-k, H hidden, S local slots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from expertmesh import wire
from expertmesh.errors import (
    ExpertMeshError,
    Incompatible,
    Internal,
    InvalidRequest,
    StaleGeneration,
    Unavailable,
)
from expertmesh.experts import ExpertBackend
from expertmesh.lora import LoRABatch
from expertmesh.lora.store import AdapterStore, AdapterStoreError, LayerAdapter
from expertmesh.metrics import WorkerMetrics
from expertmesh.transport.descriptor import LinkStep
from expertmesh.worker import memory
from expertmesh.worker.combine import StreamCombiner
from expertmesh.worker.lease import PlacementLease
from expertmesh.worker.slots import SlotTable
from expertmesh.worker_api import ExpertRequest, WorkerInfo

MAX_TOP_K = 64
log = logging.getLogger("expertmesh.worker")


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
    # host-link steps (cpu_expert_server/hostlink.py): the kernel thread's own time in its kernels
    # (routing copy included) and spinning for the coordinator's flags, summed over the MoE
    # layers it answered
    link_steps: int = 0
    link_layers: int = 0
    link_kernel_seconds: float = 0.0
    link_wait_seconds: float = 0.0


class ExpertWorker:
    def __init__(
        self,
        slots: SlotTable,
        backend: ExpertBackend,
        identity: WorkerIdentity,
        max_loras: int = 4,
        combine: bool = False,
        combine_wait_us: float = 0.0,
    ) -> None:
        self.slots, self.backend, self.identity = slots, backend, identity
        self.cfg = slots.reader.config
        self.stats = WorkerStats()
        self.metrics = WorkerMetrics(self)  # Prometheus /metrics (--metrics-port)
        # layer -> [S] tokens routed to each slot (a device link's counts come every
        # gpu_server/link_graphs.FOLD_EVERY steps and at its close)
        self.tokens_per_slot: dict[int, np.ndarray] = {}
        self.tokens_per_expert: dict[int, np.ndarray] = {}  # layer -> [E] since start
        # coordinators sharing this server: who may push placements (expertmesh/worker/lease.py)
        self.lease = PlacementLease()
        self.adapter_sources: dict[str, str] = {}  # adapter name -> where its coordinator read it
        # MoE-LoRA adapter slots pushed here (LoadAdapter); -1 in a request = no adapter
        self.adapter_slots: frozenset[int] = frozenset()
        self.lora = AdapterStore(max_loras, slots.dtype, slots.device)
        # NOTE: compute and commit hold this lock: requests come from the gRPC compute thread,
        # the event loop (small ones) and fast-path channel threads.
        self._serial = threading.Lock()
        # graceful drain: why new streams are refused ("" = serving), why layers are refused
        # too ("" while open streams are still answered: the coordinators' notice), and the
        # Forward streams open now (the drain waits for coordinators to move off)
        self.draining = ""
        self.refusing = ""
        self.open_streams = 0
        # the host links open on this server (cpu_expert_server/hostlink.py): a commit waits for their steps
        self._host_links: weakref.WeakSet[Any] = weakref.WeakSet()
        # fast-path requests of several streams for one layer computed together (opt-in), a
        # request held up to ``combine_wait_us`` for the other streams' request of its layer
        self.combiner = StreamCombiner(self, slots.moe_layers, combine_wait_us) if combine else None

    def info(self) -> WorkerInfo:
        cfg, ident = self.cfg, self.identity
        dev_now, dev_peak = memory.device_bytes(self.slots.device)
        return WorkerInfo(
            kind=ident.kind,
            device=ident.device,
            dtype=self.slots.dtype,
            backend=self.backend.name,
            model_type=cfg.model_type,
            hidden_size=cfg.hidden_size,
            num_experts=cfg.num_experts,
            moe_layers=tuple(self.slots.moe_layers),
            slot_capacity=self.slots.capacity,
            host_id=ident.host_id,
            fast_paths=ident.fast_paths,
            generation=self.slots.live.generation,
            device_uuid=ident.device_uuid,
            max_message_bytes=ident.max_message_bytes,
            weight_dtype=self.backend.weight_dtype or wire.dtype_name(self.slots.dtype),
            weight_bytes=self.slots.resident_bytes(),
            peak_weight_bytes=self.slots.peak_bytes,
            process_rss_bytes=memory.process_rss_bytes(),
            process_peak_rss_bytes=memory.process_peak_rss_bytes(),
            device_allocated_bytes=dev_now,
            device_peak_allocated_bytes=dev_peak,
        )

    # ------------------------------------------------------------ checks

    def check(self, req: ExpertRequest) -> ExpertRequest:
        """The checks of a decoded request, whichever path it came by."""
        if self.refusing:  # NOTE: UNAVAILABLE: the coordinator re-sends the layer to replicas
            raise Unavailable(self.refusing)
        live = self.slots.live
        if live.committing:  # NOTE: its layers are being rewritten: the request's generation goes
            raise StaleGeneration(f"placement generation {live.generation} is being replaced")
        if live.broken:  # a commit that failed half-way
            raise Unavailable(live.broken)
        layer, x, slot_ids, weights = req.layer, req.hidden, req.slot_ids, req.weights
        if layer not in live.layers:
            raise InvalidRequest(
                f"layer {layer} is not an MoE layer of this model (MoE layers: {self.slots.moe_layers})"
            )
        prev = None
        if req.generation != live.generation:
            # NOTE: the generation the last commit replaced is still answered (on the live slots
            # holding its experts): coordinators following another's placement switch a moment later
            prev = self.slots.previous
            if prev is None or prev.generation != req.generation:
                raise StaleGeneration(
                    f"placement generation {req.generation} is not the live generation {live.generation}"
                )
        h = self.cfg.hidden_size
        if x.dtype != self.slots.dtype:
            raise InvalidRequest(
                f"hidden has dtype {wire.dtype_name(x.dtype)}, this server computes in {wire.dtype_name(self.slots.dtype)}"
            )
        if x.dim() != 2 or x.shape[1] != h:
            raise InvalidRequest(f"hidden has shape {list(x.shape)}, expected [T, {h}]")
        t = x.shape[0]
        if slot_ids.dtype != torch.int32 or slot_ids.dim() != 2 or slot_ids.shape[0] != t:
            raise InvalidRequest(
                f"slot_ids must be int32 [{t}, K], got {wire.dtype_name(slot_ids.dtype)} {list(slot_ids.shape)}"
            )
        k = slot_ids.shape[1]
        if not 0 < k <= MAX_TOP_K:
            raise InvalidRequest(f"top-k {k} outside [1, {MAX_TOP_K}]")
        if weights.dtype != torch.float32 or tuple(weights.shape) != (t, k):
            raise InvalidRequest(
                f"weights must be float32 [{t}, {k}], got {wire.dtype_name(weights.dtype)} {list(weights.shape)}"
            )
        n_slots = len(live.layers[layer].experts) if prev is None else len(prev.to_live[layer])
        if t:
            # NOTE: numpy on the host: on a few dozen ids its min/max cost a fraction of torch's
            ids = slot_ids.numpy() if slot_ids.device.type == "cpu" else None
            lo, hi = (
                (int(ids.min()), int(ids.max()))
                if ids is not None
                else (int(v) for v in torch.aminmax(slot_ids))
            )
            if lo < -1 or hi >= n_slots:
                raise InvalidRequest(
                    f"slot ids must be -1 or in [0, {n_slots}) for layer {layer}; got range [{lo}, {hi}]"
                )
        if t and not bool(np.isfinite(weights.numpy()).all()):
            raise InvalidRequest("weights contain NaN or infinity")
        if req.adapter_slots is not None:
            self._check_adapters(req.adapter_slots, t)
        if prev is not None:
            moved = prev.translate(layer, slot_ids)  # [T, K] live slots
            if moved is None:
                raise StaleGeneration(
                    f"placement generation {req.generation} was replaced by {live.generation}, and experts "
                    f"it routes to layer {layer} here are no longer on this server"
                )
            req = dataclasses.replace(req, generation=live.generation, slot_ids=moved)
        return req

    def _check_adapters(self, a: torch.Tensor, t: int) -> None:
        if a.dtype != torch.int32 or tuple(a.shape) != (t,):
            raise InvalidRequest(
                f"adapter_slots must be int32 [{t}], got {wire.dtype_name(a.dtype)} {list(a.shape)}"
            )
        used = set(np.unique(a.numpy()).tolist()) - {-1}
        missing = sorted(used - self.adapter_slots)
        if missing:
            loaded = sorted(self.adapter_slots) or "none"
            raise InvalidRequest(f"adapter slots {missing} hold no adapter on this server (loaded: {loaded})")

    # ------------------------------------------------------------ drain

    def start_drain(self, reason: str, layers: bool = True) -> None:
        """From now on new streams are refused (UNAVAILABLE, ``reason``), and new layers too
        with ``layers`` (without: the open streams are still answered)."""
        self.draining = reason
        if layers:
            self.refusing = reason

    def stream_opened(self) -> None:
        """A Forward stream starts (refused while draining)."""
        if self.draining:
            raise Unavailable(self.draining)
        self.open_streams += 1

    def stream_closed(self) -> None:
        self.open_streams -= 1

    def wait_idle(self, timeout: float) -> bool:
        """Waits (a worker thread) until no layer is being computed; False after ``timeout``."""
        if not self._serial.acquire(timeout=max(0.0, timeout)):
            return False
        self._serial.release()
        return True

    # ------------------------------------------------------------ compute

    def compute(self, req: ExpertRequest, to_host: bool = True) -> torch.Tensor:
        """``[T, H]`` on the host, or on the server's device (``to_host=False``: the fast paths
        copy it where the coordinator reads it)."""
        with self._serial:
            return self._compute_locked(req, to_host)

    def try_compute(self, req: ExpertRequest) -> torch.Tensor | None:
        """Computes now (on the caller's thread) if nobody else is computing, else None."""
        if not self._serial.acquire(blocking=False):
            return None
        try:
            return self._compute_locked(req, True)
        finally:
            self._serial.release()

    def forward(self, req: ExpertRequest) -> torch.Tensor:
        """Check + compute for a fast-path request (on its channel's thread): ``[T, H]`` on device."""
        try:
            return self.compute(self.check(req), to_host=False)
        except ExpertMeshError as e:
            self.count_error(e)
            raise

    def forward_built(self, req: ExpertRequest) -> torch.Tensor:
        """Compute for a request its caller built from the placement this worker holds (the
        coordinator's in-process member, coordinator/experts/local.py): shapes, dtypes and slot
        ranges hold by construction, so only what the caller cannot know is checked (a commit
        since, the adapter slots loaded here). ``[T, H]`` on device. The full :meth:`check` is
        ~40% of a small layer's CPU compute on the coordinator's critical path."""
        try:
            if req.adapter_slots is not None:
                self._check_adapters(req.adapter_slots, req.tokens)
            return self.compute(req, to_host=False)
        except ExpertMeshError as e:
            self.count_error(e)
            raise

    def forward_into(self, req: ExpertRequest, out: torch.Tensor) -> None:
        """Check + compute for a fast-path request, the answer written into ``out [T, H]`` (the
        ring the coordinator reads; on the GPU: queued on this device's stream, not waited for),
        with the requests of other streams waiting for the same layer when combining
        (expertmesh/worker/combine.py)."""
        if self.combiner is not None:
            self.combiner.forward_into(req, out)
        else:
            self.forward_into_alone(req, out)

    def forward_into_alone(self, req: ExpertRequest, out: torch.Tensor) -> None:
        try:
            with self._serial:
                loaded = self._load_input(req)
                req = self.check(req)
                self._compute_locked(req, False, out, loaded)
        except ExpertMeshError as e:
            self.count_error(e)
            raise

    def _load_input(self, req: ExpertRequest) -> object | None:
        """The hidden states' copy into a graphed backend's input, issued before the checks:
        the first GPU work of the request (gpu_server/graphs.py ``load_input``); harmless when
        the checks then refuse the request (nothing reads that input until a replay)."""
        load = getattr(self.backend, "load_input", None)
        live = self.slots.live
        layer = live.layers.get(req.layer)
        x = req.hidden
        if (
            load is None
            or layer is None
            or req.adapter_slots is not None
            or req.generation != live.generation
            or x.dtype != self.slots.dtype
            or x.dim() != 2
            or x.shape[1] != self.cfg.hidden_size
            or req.slot_ids.dim() != 2
        ):
            return None
        return load(x, layer.w13, layer.w2, req.slot_ids.shape[1])

    def count_error(self, err: ExpertMeshError | None = None) -> None:
        self.stats.errors += 1
        self.metrics.reject(err)

    def data_path_error(self, reason: str, err: ExpertMeshError | None = None) -> None:
        """A data connection dropped (a malformed or truncated frame, a bad preamble): counted
        with the errors, and by ``reason`` (expertmesh/transport/tcp_server.py DROP_REASONS)."""
        self.count_error(err)
        self.metrics.dropped(reason)

    def _compute_locked(
        self, req: ExpertRequest, to_host: bool, into: torch.Tensor | None = None, loaded: object = None
    ) -> torch.Tensor:
        live = self.slots.live
        if live.broken:
            raise Unavailable(live.broken)
        if live.generation != req.generation:  # a commit ran between check and compute
            raise StaleGeneration(f"placement generation {req.generation} was replaced by {live.generation}")
        layer = live.layers[req.layer]
        t0 = time.perf_counter()
        dev = self.slots.device
        # NOTE: the gRPC path runs on threads whose current GPU is cuda:0: a server on cuda:1
        # launches its Triton kernels with its own device current
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            lora = self._lora(req, layer.experts)
            x = req.hidden
            # gpu_server/graphs.py (graphed GPU calls), cpu_expert_server/backend.py (integer-dot decode, AMX)
            direct = getattr(self.backend, "forward_into", None)
            dst: torch.Tensor | None = None
            if direct is not None and lora is None and req.slot_ids.device.type == "cpu":
                # routing stays on the host (a GPU graph uploads it, the CPU kernel reads it), the
                # answer goes straight to ``into`` (the fast path's ring) when there is one
                dst = into if into is not None else torch.empty(x.shape, dtype=x.dtype, device=dev)
                if not direct(x, layer.w13, layer.w2, req.slot_ids, req.weights, dst, loaded):
                    dst = None
            if dst is None:
                dst = self.backend.forward(
                    x.to(dev, non_blocking=True),
                    layer.w13,
                    layer.w2,
                    req.slot_ids.to(dev, non_blocking=True),
                    req.weights.to(dev, non_blocking=True),
                    lora,
                )
                if into is not None:
                    into.copy_(dst)
                    dst = into
        out = dst.cpu() if to_host and into is None else dst
        dt = time.perf_counter() - t0
        self.stats.compute_seconds += dt
        self.metrics.compute(req.layer, dt)
        self.stats.requests += 1
        self.stats.tokens += req.hidden.shape[0]
        # NOTE: numpy: on these few numbers its ops cost a fraction of torch's per-op overhead
        ids = req.slot_ids.numpy().ravel()  # [T * K]
        counts = np.bincount(ids[ids >= 0], minlength=len(layer.experts))  # [S]
        self._count_experts(req.layer, layer.experts, counts)
        prev = self.tokens_per_slot.get(req.layer)
        if prev is None or prev.shape != counts.shape:
            self.tokens_per_slot[req.layer] = counts
        else:
            prev += counts
        return out

    def _count_experts(self, layer: int, experts: tuple[int, ...], per_slot: np.ndarray) -> None:
        """Adds ``per_slot [S]`` tokens of ``layer``'s slots holding ``experts`` to its
        per-logical-expert counts ``[E]`` (which outlive placement changes: every coordinator's
        EPLB reads them from Stats)."""
        n = self.cfg.num_experts
        per_expert = np.bincount(
            np.asarray(experts, dtype=np.int64), weights=per_slot[: len(experts)], minlength=n
        ).astype(np.int64)
        prev = self.tokens_per_expert.get(layer)
        if prev is None:
            self.tokens_per_expert[layer] = per_expert[:n]
        else:
            prev += per_expert[:n]

    def _lora(self, req: ExpertRequest, experts: tuple[int, ...]) -> LoRABatch | None:
        """The request's MoE-LoRA inputs: resident buffers of its layer (LRU-loaded) and each
        token's buffer index; None when no token names an adapter."""
        a = req.adapter_slots
        if a is None or not bool((a >= 0).any()):
            return None
        # slots check() accepted but with no weights in the store adapt nothing on this server
        known = torch.tensor(sorted(self.lora.adapters), dtype=a.dtype)
        a = torch.where(torch.isin(a, known), a, -1)
        if not bool((a >= 0).any()):
            return None
        try:
            index = self.lora.buffer_index(a.long())  # [T]
        except AdapterStoreError as e:
            raise InvalidRequest(str(e)) from e
        weights = self.lora.weights(req.layer, experts)
        if weights is None:  # no adapter touches this layer's experts
            return None
        return LoRABatch(weights, index.to(self.slots.device))

    # ------------------------------------------------------------ device link

    def open_link(
        self,
        request: torch.Tensor,
        rows: int,
        top_k: int,
        answer: torch.Tensor | None = None,
        hidden: int | None = None,
        dtype: torch.dtype | None = None,
        relayed: bool = False,
    ) -> Any:
        """The server's side of a link over the coordinator's ``request`` area for ``rows``
        rows and top-k ``top_k``: with no ``answer``, the device link's step graphs (``request``
        mapped on our GPU; gpu_server/graphs.py -> gpu_server/link_graphs.py); with ``answer``
        (both areas in the coordinator's shared-memory segment, of the offer's ``hidden`` and
        ``dtype``), the host link on the backend's kernel thread (cpu_expert_server/hostlink.py); with an ``answer``
        on our GPU (a relay's host areas, mapped), the step graphs answering there. Raises
        Incompatible when this server cannot serve it (the fast path then goes on without).
        ``relayed``: the areas are a relay's own (expertmesh/transport/tcp_relay.py), which
        hands a micro-batched step's requests over one at a time: such a link takes them."""
        opener = getattr(self.backend, "open_link", None)
        # NOTE: an ``answer`` on our GPU: a relayed link's host areas mapped for the device
        # link's graphs (expertmesh/transport/tcp_relay.py), which answer there, not in an area
        # of their own
        host = answer is not None and answer.device.type == "cpu"
        if host and (opener is None or not getattr(self.backend, "host_link", False)):
            raise Incompatible(
                f"the {self.backend.name} backend serves no host link (a CPU server's C kernels do)"
            )
        if opener is None or (not host and getattr(self.backend, "host_link", False)):
            raise Incompatible(
                f"the {self.backend.name} backend runs no CUDA graphs (the link needs the GPU "
                "server's graphs: a CPU server, --no-cuda-graphs or FP8)"
            )
        if not 0 < top_k <= MAX_TOP_K:
            raise Incompatible(f"link top-k {top_k} outside [1, {MAX_TOP_K}]")
        h = self.cfg.hidden_size
        if answer is not None and (hidden, dtype) != (h, self.slots.dtype):
            theirs = wire.dtype_name(dtype) if dtype is not None else "?"
            raise Incompatible(
                f"the link offers hidden {hidden} in {theirs}; this server computes hidden {h} "
                f"in {wire.dtype_name(self.slots.dtype)}"
            )
        try:
            if answer is not None:
                opened = opener(request, rows, h, top_k, self.slots.dtype, answer=answer)
            else:
                opened = opener(request, rows, h, top_k, self.slots.dtype)
        except ValueError as e:  # an area too small for what it claims to hold
            raise Incompatible(str(e)) from None
        if host:
            self._host_links.add(opened)
        opened.relayed = relayed
        return opened

    def link_step(self, graphs: Any, step: LinkStep) -> None:
        """Launches a linked decode step's graph (queued on this device's stream, not waited
        for); typed errors refuse the step (the coordinator runs it without the link)."""
        # NOTE: the last step's report first, outside the lock: its graph has normally finished,
        # but after a coordinator's death it may spin until its timeout (other channels compute)
        report = graphs.collect()
        try:
            with self._serial:  # NOTE: a placement commit never lands between check and launch
                if report is not None:
                    self._link_report(graphs, report)
                if self.refusing:
                    raise Unavailable(self.refusing)
                live = self.slots.live
                if live.broken:
                    raise Unavailable(live.broken)
                if step.generation != live.generation:
                    raise StaleGeneration(
                        f"placement generation {step.generation} is not the live generation {live.generation}"
                    )
                # NOTE: no refusal for loaded LoRA adapters: a linked step is a base-model step
                # by construction (the coordinator's decode graphs hold the base model; a step
                # with an adapter runs eagerly), so the host link's C kernels need no LoRA
                # a micro-batched step: ``micro`` requests of bucket / micro rows per MoE layer
                bucket, micro = step.bucket // step.micro, step.micro
                graphs.check(bucket, step.step, step.timeout_ms, micro)
                t0 = time.perf_counter()
                dev = self.slots.device
                weights = [(live.layers[i].w13, live.layers[i].w2) for i in self.slots.moe_layers]
                with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                    report = graphs.launch(
                        live.generation,
                        weights,
                        bucket,
                        step.step,
                        min(step.rows, bucket),
                        step.timeout_ms,
                        micro,
                    )
                self.stats.compute_seconds += time.perf_counter() - t0
                self.stats.requests += len(weights)  # a linked step computes every MoE layer
                self.stats.tokens += step.rows * len(weights)
                if report is not None:  # collected above: none normally
                    self._link_report(graphs, report)
        except ExpertMeshError as e:
            self.count_error(e)
            raise

    def cancel_link(self, graphs: Any) -> None:
        """Ends the link's step in flight at once (its channel closed; any thread, no lock)."""
        graphs.cancel()

    def close_link(self, graphs: Any) -> None:
        """Waits for the link's last step graph (bounded: its waits time out), counts it."""
        report = graphs.close()  # NOTE: outside the lock: other channels compute meanwhile
        if report is not None:
            with self._serial:
                self._link_report(graphs, report)

    def _link_report(self, graphs: Any, report: Any) -> None:
        """Folds a finished step's token counts into the stats; a step that timed out or met
        bad slot ids is an error, logged once per link and kind."""
        kernel_ns = getattr(graphs, "kernel_ns", None)
        if kernel_ns is not None:  # a host link's step: the kernel thread's own split
            st = self.stats
            st.link_steps += 1
            st.link_layers += getattr(graphs, "layers_answered", len(self.slots.moe_layers))
            st.link_kernel_seconds += kernel_ns / 1e9
            st.link_wait_seconds += graphs.wait_ns / 1e9
        live = self.slots.live
        for layer, counts in zip(self.slots.moe_layers, report.counts):
            if counts.shape[0] == len(live.layers[layer].experts):
                self._count_experts(layer, live.layers[layer].experts, counts)
            prev = self.tokens_per_slot.get(layer)
            if prev is None or prev.shape != counts.shape:
                self.tokens_per_slot[layer] = counts.copy()  # NOTE: never an alias of the report's
            else:
                prev += counts
        for what, err in (
            ("timed_out", Unavailable("the coordinator did not signal a layer in time")),
            ("bad_slots", InvalidRequest("slot ids outside this layer's slots (computed as -1 or zeros)")),
            ("kernel_failed", Internal("the host link's kernel refused a layer (answered zeros)")),
        ):
            if getattr(report, what, False):
                self.count_error(err)
                if what not in graphs.logged:
                    graphs.logged.add(what)
                    log.warning(
                        "link step %d: %s; the rest of the step ran through (logged once per link)",
                        report.step,
                        err.message,
                    )

    # ------------------------------------------------------------ MoE LoRA adapters

    def load_adapter(
        self, adapter_slot: int, name: str, layers: dict[int, LayerAdapter], source: str = ""
    ) -> None:
        """Keeps ``layers`` (this server's experts of each MoE layer) as adapter ``adapter_slot``
        (again for the same name: its experts change with the placement). A slot holding
        another adapter is refused: two coordinators sharing this server chose the same slot,
        and replacing it would silently change the other's requests."""
        if adapter_slot < 0:
            raise InvalidRequest(f"adapter_slot must be >= 0, got {adapter_slot}")
        with self._serial:
            held = self.lora.names().get(adapter_slot)
            if held is not None and held != name:
                raise InvalidRequest(
                    f"adapter slot {adapter_slot} holds adapter {held!r}; unload it before loading {name!r} there"
                )
            self.lora.add(adapter_slot, name, layers)
            self.adapter_slots = frozenset(self.lora.adapters)
            if source:
                self.adapter_sources[name] = source

    def unload_adapter(self, name: str) -> bool:
        """Drops every adapter slot holding ``name``; False if there was none."""
        with self._serial:
            ids = [i for i, n in self.lora.names().items() if n == name]
            for i in ids:
                self.lora.remove(i)
            self.adapter_sources.pop(name, None)
            self.adapter_slots = frozenset(self.lora.adapters)
        return bool(ids)

    # ------------------------------------------------------------ placement (two phases)

    def prepare(self, generation: int, table: dict[int, list[int]]) -> int:
        """Loads the slot table of ``generation`` beside the live one; returns experts read."""
        for layer, experts in table.items():
            bad = [e for e in experts if not 0 <= e < self.cfg.num_experts]
            if bad:
                raise InvalidRequest(f"layer {layer}: experts {bad} outside [0, {self.cfg.num_experts})")
        t0 = time.perf_counter()
        read = self.slots.prepare(generation, table)
        log.info(
            "placement generation %d prepared in %.0f ms: %s",
            generation, (time.perf_counter() - t0) * 1e3, self.slots.last_prepare,
        )  # fmt: skip
        return read

    def commit(self, generation: int, release: bool = True) -> None:
        """Makes ``generation`` live. ``release``: hand the freed memory back before returning;
        the gRPC server passes False and releases after its reply (:meth:`release`), so that
        the coordinator's between-steps window does not wait for the allocator."""
        t0 = time.perf_counter()
        with self._serial:
            # NOTE: a host link's kernel thread reads the live weights with no lock: its step in
            # flight ends first (bounded: its waits time out); new steps wait for this lock
            t_lock = time.perf_counter()
            for hl in list(self._host_links):
                report = hl.collect()
                if report is not None:
                    self._link_report(hl, report)
            t_link = time.perf_counter()
            self.slots.commit(generation)
        t1 = time.perf_counter()
        log.info(
            "placement generation %d committed in %.1f ms (waiting for the compute lock %.1f, "
            "host links %.1f, slots %.1f: %s)",
            generation, (t1 - t0) * 1e3, (t_lock - t0) * 1e3, (t_link - t_lock) * 1e3, (t1 - t_link) * 1e3,
            self.slots.last_commit.line(),
        )  # fmt: skip
        if release:
            self.release()

    def release(self) -> None:
        """Hands what the last commit freed back to the device or the OS (outside the compute
        lock: requests compute meanwhile)."""
        t0 = time.perf_counter()
        dropped = self.slots.release()
        log.info(
            "freed placement memory released in %.1f ms (%.0f MiB of host pages returned a chunk at a time)",
            (time.perf_counter() - t0) * 1e3, dropped / 2**20,
        )  # fmt: skip

    def abort(self, generation: int) -> None:
        self.slots.abort(generation)

    @property
    def generation(self) -> int:
        return self.slots.live.generation
