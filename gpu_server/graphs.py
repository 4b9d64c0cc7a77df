"""CUDA graphs of the GPU expert server's decode-sized requests.

Why: a decode request (a few tokens) is ~40 us of GPU work at Qwen3-30B-A3B widths but six
Triton launches and their Python around them, ~150-200 us of host time per layer on the lent
H100's host, all on the critical path of the coordinator's layer loop. A replayed graph is
one launch.

One graph per (layer's weight tensors, token bucket), captured on first use: a static input
``x [Tb, H]`` each request copies into, ``slot_ids [Tb, K]`` / ``weights [Tb, K]`` that the
graph's first node fills from a pinned host block (padding rows get slot -1, which computes
nothing), a static output read back as its first T rows.
Graphs are keyed by and computed over a layer's whole allocation (the slot table's live slots
are its first S, spare slots past them; a slot id never reaches past S), so a commit that
rewrites or resizes a layer inside its allocation keeps its graphs: only a new allocation
means new keys (and captures on the next requests; the oldest graphs are dropped past
``max_graphs``). Requests with LoRA adapters, more tokens than the largest bucket,
or off CUDA go to the inner backend unchanged.

The fast paths call :meth:`GraphedBackend.forward_into`: the routing comes as host memory and
is uploaded by the graph itself (a copy node from a pinned staging block of the bucket), and the
answer is copied straight to where the coordinator reads it. Per request that is three GPU
calls (hidden in, replay, answer out) instead of seven, and no per-request pinned allocation:
on the lent H100's host each call from Python costs ~10-20 us, on the critical path of every
remote layer.

Shapes: T tokens, Tb bucket, H hidden, K top-k, S slots.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from expertmesh.experts import ExpertBackend
from expertmesh.worker import memory
from gpu_server.link_graphs import LinkGraphs

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # [Tb, H]
    slot_ids: torch.Tensor  # [Tb, K] int32 (a view of route)
    weights: torch.Tensor  # [Tb, K] float32 (a view of route)
    out: torch.Tensor  # [Tb, H]
    staging: _Staging  # the pinned routing block the graph uploads first


class _Staging:
    """A pinned ``[2, Tb, K]`` int32 routing block (slot ids, then float32 weight bits) that
    the graphs of one (bucket, K) upload from; ``used`` is recorded after each replay that read
    it, so the host never rewrites it under an upload still queued."""

    def __init__(self, bucket: int, top_k: int, device: torch.device) -> None:
        self.device = device
        self.host = torch.full((2, bucket, top_k), -1, dtype=torch.int32, pin_memory=True)
        self.np = self.host.numpy()  # [2, Tb, K]
        self.np[1] = 0  # padding weights
        self.used = torch.cuda.Event()
        self.rows = bucket  # rows the last request wrote (the rest hold -1)
        self.pending = False

    def fill(self, slot_ids, weights) -> None:
        """``slot_ids [T, K]`` int32, ``weights [T, K]`` float32 (numpy, host)."""
        if self.pending:
            self.used.synchronize()  # NOTE: the last upload from here may still be queued
        t = slot_ids.shape[0]
        self.np[0, :t] = slot_ids
        self.np[1, :t] = weights.view(np.int32)
        if self.rows > t:  # rows a larger request left: padding (slot -1, weight 0) again
            self.np[0, t : self.rows] = -1
            self.np[1, t : self.rows] = 0
        self.rows = t

    def replayed(self) -> None:
        """After a replay that uploads from here (on our device's stream: the caller's thread
        may have another device current, e.g. the gRPC path of a server on cuda:1)."""
        self.used.record(torch.cuda.current_stream(self.device))
        self.pending = True


class GraphedBackend(ExpertBackend):
    """Wraps a backend whose ``forward`` has no host synchronisation at decode sizes (the
    Triton fused MoE, gpu_server/backend.py)."""

    def __init__(self, inner: ExpertBackend, buckets: tuple[int, ...] = BUCKETS, max_graphs: int = 1024):
        assert buckets and list(buckets) == sorted(buckets) and buckets[0] > 0, f"{buckets=}"
        self.inner, self.buckets, self.max_graphs = inner, buckets, max_graphs
        self.name, self.weight_dtype = inner.name, inner.weight_dtype
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._staging: dict[tuple[int, int], _Staging] = {}  # (bucket, K) -> pinned routing block
        self._pool: Any = None  # the graphs' shared memory pool, made at the first capture

    def pack_weights(self, w13, w2):
        return self.inner.pack_weights(w13, w2)

    def graph_for(self, x, w13, w2, top_k: int) -> _Graph | None:
        """The graph for ``x [T, H]`` with these weights (captured now if new); None when a
        request of this size is not graphed."""
        t = x.shape[0]
        bucket = next((b for b in self.buckets if b >= t), None)
        if bucket is None or t == 0 or not w13.is_cuda:
            return None
        w13, w2 = allocation(w13), allocation(w2)
        key = (w13.data_ptr(), w2.data_ptr(), tuple(w13.shape), tuple(w2.shape), x.dtype, top_k, bucket)
        g = self._graphs.get(key)
        if g is None:
            return self._capture(key, x, w13, w2, top_k, bucket)
        self._graphs.move_to_end(key)
        return g

    def load_input(self, x, w13, w2, top_k: int) -> _Graph | None:
        """Copies ``x [T, H]`` into its graph's input now (the first GPU work of a request: on a
        GPU shared with the coordinator this starts the switch to our context while the host
        still checks the request); pass the result to :meth:`forward_into` as ``loaded``.
        None when the request is not graphed. The caller holds the lock that serialises
        requests until that forward_into."""
        g = self.graph_for(x, w13, w2, top_k)
        if g is not None:
            g.x[: x.shape[0]].copy_(x, non_blocking=True)
        return g

    def forward_into(
        self, x, w13, w2, slot_ids, weights, out: torch.Tensor, loaded: _Graph | None = None
    ) -> bool:
        """Writes the MoE of ``x [T, H]`` (the GPU, or host memory: copied in by DMA when it is
        pinned) into ``out [T, H]`` (any device) with the routing ``slot_ids [T, K]`` int32 /
        ``weights [T, K]`` float32 given as host tensors; False (nothing done) when this request
        is not graphed. The caller orders what reads ``out`` after this stream."""
        g = loaded if loaded is not None else self.graph_for(x, w13, w2, slot_ids.shape[1])
        if g is None:
            return False
        t = x.shape[0]
        g.staging.fill(slot_ids.numpy(), weights.numpy())
        if loaded is None:
            g.x[:t].copy_(x, non_blocking=True)
        g.graph.replay()  # uploads the staging block first
        g.staging.replayed()
        # NOTE: stream-ordered before the next replay of this graph (one stream per device)
        out.copy_(g.out[:t], non_blocking=out.is_cuda)
        return True

    def forward(self, x, w13, w2, slot_ids, weights, lora=None):
        g = None if lora is not None or not x.is_cuda else self.graph_for(x, w13, w2, slot_ids.shape[1])
        if g is None:
            return self.inner.forward(x, w13, w2, slot_ids, weights, lora)
        t = x.shape[0]
        # the graph uploads its routing from host memory (a routing already on the GPU comes
        # back once: the fast paths and the gRPC path hand it over on the host)
        g.staging.fill(slot_ids.cpu().numpy(), weights.float().cpu().numpy())
        g.x[:t].copy_(x)
        g.graph.replay()
        g.staging.replayed()
        # NOTE: a copy: the fast path reads the output after the worker's compute lock is
        # released, and another stream's request for this graph may replay it meanwhile
        return g.out[:t].clone()

    def open_link(
        self,
        request: torch.Tensor,
        rows: int,
        hidden: int,
        top_k: int,
        dtype: torch.dtype,
        answer: torch.Tensor | None = None,
    ) -> LinkGraphs:
        """The device link's step graphs over the coordinator's mapped ``request`` area
        (gpu_server/link_graphs.py): the same kernels as these graphs, a pool of their own;
        ``answer``: the area to answer in (on our device) instead of one of their own."""
        return LinkGraphs(self.inner, request, rows, hidden, top_k, dtype, self.buckets, answer=answer)

    def _capture(self, key: tuple, x: torch.Tensor, w13, w2, top_k: int, bucket: int) -> _Graph:
        dev = w13.device  # NOTE: x may sit in (pinned) host memory: the fast paths' shm ring
        staging = self._staging.get((bucket, top_k))
        if staging is None:
            staging = self._staging[(bucket, top_k)] = _Staging(bucket, top_k, dev)
        if staging.pending:  # the warm-up below writes the device block the staging feeds
            staging.used.synchronize()
        xs = torch.zeros(bucket, x.shape[1], dtype=x.dtype, device=dev)
        route = torch.full((2, bucket, top_k), -1, dtype=torch.int32, device=dev)  # [2, Tb, K]
        ids, ws = route[0], route[1].view(torch.float32)  # [Tb, K] each
        ws.zero_()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            self.inner.forward(xs, w13, w2, ids, ws)  # warm-up: Triton compiles for this shape
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread_local: the server's other threads may use CUDA meanwhile
        with (
            memory.capturing(),
            torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"),
        ):
            route.copy_(staging.host, non_blocking=True)  # a copy node: host routing -> device
            out = self.inner.forward(xs, w13, w2, ids, ws)
        torch.cuda.current_stream(dev).wait_stream(stream)
        g = self._graphs[key] = _Graph(graph, xs, ids, ws, out, staging)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return g


def allocation(t: torch.Tensor) -> torch.Tensor:
    """The whole allocation ``[A, ...]`` that the slots ``t [S, ...]`` are the first S rows of
    (slot_state.LayerSlots: a table's live slots are a view of its allocation), or ``t`` itself.
    Graphs capture this, not the view: a resize inside the allocation changes S, not A."""
    if t.dim() == 0 or t.shape[0] == 0 or t.storage_offset() != 0 or not t.is_contiguous():
        return t
    rows = t.untyped_storage().nbytes() // t[0].nbytes
    if rows <= t.shape[0]:
        return t
    return t.new_empty(0).set_(t.untyped_storage(), 0, (rows, *t.shape[1:]), (t.stride(0), *t.stride()[1:]))
