"""CUDA graphs of the GPU expert server's decode-sized requests.

Why: a decode request (a few tokens) is ~40 us of GPU work at Qwen3-30B-A3B widths but six
Triton launches and their Python around them, ~150-200 us of host time per layer on the lent
H100's host, all on the critical path of the coordinator's layer loop. A replayed graph is
one launch.

One graph per (layer's weight tensors, token bucket), captured on first use: static inputs
``x [Tb, H]``, ``slot_ids [Tb, K]``, ``weights [Tb, K]`` that each request copies into (padding
rows get slot -1, which computes nothing), a static output read back as its first T rows.
A placement commit gives a layer new weight tensors, hence new keys; the oldest graphs are
dropped past ``max_graphs``. Requests with LoRA adapters, more tokens than the largest bucket,
or off CUDA go to the inner backend unchanged.

Shapes: T tokens, Tb bucket, H hidden, K top-k, S slots.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from expertmesh.experts import ExpertBackend

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # [Tb, H]
    slot_ids: torch.Tensor  # [Tb, K] int32
    weights: torch.Tensor  # [Tb, K] float32
    out: torch.Tensor  # [Tb, H]
    rows: int  # rows of slot_ids the last request wrote (the rest hold -1)


class GraphedBackend(ExpertBackend):
    """Wraps a backend whose ``forward`` has no host synchronisation at decode sizes (the
    Triton fused MoE, gpu_server/backend.py)."""

    def __init__(self, inner: ExpertBackend, buckets: tuple[int, ...] = BUCKETS, max_graphs: int = 1024):
        assert buckets and list(buckets) == sorted(buckets) and buckets[0] > 0, f"{buckets=}"
        self.inner, self.buckets, self.max_graphs = inner, buckets, max_graphs
        self.name, self.weight_dtype = inner.name, inner.weight_dtype
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._pool: Any = None  # the graphs' shared memory pool, made at the first capture

    def pack_weights(self, w13, w2):
        return self.inner.pack_weights(w13, w2)

    def forward(self, x, w13, w2, slot_ids, weights, lora=None):
        t = x.shape[0]
        bucket = next((b for b in self.buckets if b >= t), None)
        if lora is not None or bucket is None or t == 0 or not x.is_cuda:
            return self.inner.forward(x, w13, w2, slot_ids, weights, lora)
        key = (
            w13.data_ptr(),
            w2.data_ptr(),
            tuple(w13.shape),
            tuple(w2.shape),
            x.dtype,
            slot_ids.shape[1],
            bucket,
        )
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(key, x, w13, w2, slot_ids.shape[1], bucket)
        else:
            self._graphs.move_to_end(key)
        g.x[:t].copy_(x)
        g.slot_ids[:t].copy_(slot_ids)
        g.weights[:t].copy_(weights)
        if g.rows > t:  # rows a larger request left: padding again
            g.slot_ids[t : g.rows].fill_(-1)
        g.rows = t
        g.graph.replay()
        # NOTE: a copy: the fast path reads the output after the worker's compute lock is
        # released, and another stream's request for this graph may replay it meanwhile
        return g.out[:t].clone()

    def _capture(self, key: tuple, x: torch.Tensor, w13, w2, top_k: int, bucket: int) -> _Graph:
        dev = x.device
        xs = torch.zeros(bucket, x.shape[1], dtype=x.dtype, device=dev)
        ids = torch.full((bucket, top_k), -1, dtype=torch.int32, device=dev)
        ws = torch.zeros(bucket, top_k, dtype=torch.float32, device=dev)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            self.inner.forward(xs, w13, w2, ids, ws)  # warm-up: Triton compiles for this shape
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread_local: the server's other threads may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            out = self.inner.forward(xs, w13, w2, ids, ws)
        torch.cuda.current_stream(dev).wait_stream(stream)
        g = self._graphs[key] = _Graph(graph, xs, ids, ws, out, 0)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return g
