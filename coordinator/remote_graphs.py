"""Piecewise CUDA graphs of the decode step when routed experts live on expert servers.

A remote MoE layer waits on another process, which no graph can hold, so the step is captured
as a chain of graphs cut at every MoE dispatch: segment 0 runs from the embedding to layer 0's
router, segment k from layer k-1's routed-expert output to layer k's router, the last one to
the logits. Without the cuts the coordinator's per-layer work (two RMSNorms, the qkv / o
projections, rotary + KV write, attention, the router) is ~16 kernel launches from Python,
~1.7 ms per layer eagerly against ~0.09 ms of GPU work (benchmarks/RESULTS.md, issue 10).

Each cut also copies the layer's routing (``topk_ids``, ``topk_weights``) into pinned host
buffers inside the graph, so the host reads them after one event wait with no extra copy
launched from Python. Between two segments the host does the remote dispatch
(coordinator/remote.py) with the segment's static MoE input and host routing, and writes the
summed answer into the static buffer the next segment reads.

NOTE: a shared expert (DeepSeek, Qwen2-MoE) runs at the start of the next segment, after the
servers answered, so it no longer overlaps with them; the eager path keeps the overlap.

Shapes: Bm largest bucket, H hidden, K top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from coordinator.cuda_graphs import BUCKETS, DecodeGraphs
from coordinator.dispatch import Dispatcher, Pending
from coordinator.kv_cache import KVCache
from coordinator.models.base import CausalLM
from coordinator.models.moe import LoadHook

if TYPE_CHECKING:
    from coordinator.remote import RemoteDispatcher


@dataclass
class Cut:
    """One MoE layer's dispatch between two segments of a bucket's chain."""

    layer: int
    x: torch.Tensor  # [bucket, H] the layer's MoE input (static, written by the segment before)
    ids: torch.Tensor  # [bucket, K] int64 on the GPU (static), for the load hook
    ids_host: torch.Tensor  # [bucket, K] int64, pinned: filled by the segment before
    weights_host: torch.Tensor  # [bucket, K] float32, pinned
    routed: torch.Tensor  # [bucket, H] routed-expert output, read by the segment after


class _Cutter(Dispatcher):
    """Stands in for the remote dispatcher while a bucket is captured: each submit ends the
    graph being captured and starts the next one."""

    def __init__(self, owner: RemoteDecodeGraphs, bucket: int, top_k: int) -> None:
        self.owner, self.bucket = owner, bucket
        self.capturing = False
        self.cuts: list[Cut] = []
        self.segments: list[torch.cuda.CUDAGraph] = []
        # NOTE: pinned before capture: a host allocation inside a capture is not allowed
        self.host = {
            layer: (
                torch.empty(bucket, top_k, dtype=torch.long, pin_memory=True),
                torch.empty(bucket, top_k, dtype=torch.float32, pin_memory=True),
            )
            for layer in owner.routed_in
        }

    def submit(self, layer, x, topk_ids, topk_weights):
        routed = self.owner.routed_in[layer][: self.bucket]
        if not self.capturing:  # warm-up run: kernels compile, nothing is captured
            return Pending.done(routed)
        ids_host, weights_host = self.host[layer]
        ids_host.copy_(topk_ids, non_blocking=True)
        weights_host.copy_(topk_weights, non_blocking=True)
        self.segments[-1].capture_end()
        self.cuts.append(Cut(layer, x, topk_ids, ids_host, weights_host, routed))
        self.begin()
        return Pending.done(routed)

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        # NOTE: thread_local: the cluster's threads may touch CUDA while a bucket is captured
        g.capture_begin(pool=self.owner.pool, capture_error_mode="thread_local")
        self.segments.append(g)


class RemoteDecodeGraphs(DecodeGraphs):
    """Decode graphs (coordinator/cuda_graphs.py) cut at each MoE dispatch; ``dispatcher`` is
    the remote one the model is attached to."""

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        max_pages_per_seq: int,
        load_hook: LoadHook | None,
        dispatcher: RemoteDispatcher,
        buckets: tuple[int, ...] = BUCKETS,
    ) -> None:
        self.dispatcher = dispatcher
        cfg = model.config
        dev = cache.k.device
        # NOTE: allocated before any capture, so that the host may write them between replays
        self.routed_in = {
            blk.layer: torch.zeros(buckets[-1], cfg.hidden_size, dtype=cache.k.dtype, device=dev)
            for blk in model.moe_blocks()
        }
        self.chains: dict[int, tuple[list[torch.cuda.CUDAGraph], list[Cut]]] = {}
        self._views: dict[tuple[int, int], list[tuple]] = {}  # (bucket, b) -> per cut: its [:b] views
        self.pool = torch.cuda.graph_pool_handle()
        self.ready = torch.cuda.Event()
        # set to a list to get, per replayed layer, host seconds of (segment replay + routing
        # on the host, route + send, wait + copy-in): benchmarks/bench_e2e.py's profile
        self.timings: list[tuple[float, float, float]] | None = None
        super().__init__(model, cache, max_pages_per_seq, load_hook, buckets)

    def _capture_all(self) -> None:
        self._pad(0, self.buckets[-1])
        blocks = self.model.moe_blocks()
        saved = [(blk.dispatcher, blk.load_hook) for blk in blocks]
        try:
            for b in reversed(self.buckets):  # largest first: the smaller ones reuse its pool
                cutter = _Cutter(self, b, self.model.config.top_k)
                for blk in blocks:
                    blk.dispatcher, blk.load_hook = cutter, None
                batch = self._batch(b)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.model(batch, self.cache)  # warm-up: Triton compiles, cuBLAS picks kernels
                    stream.synchronize()
                    cutter.capturing = True
                    cutter.begin()
                    self.logits[b] = self.model(batch, self.cache)
                    cutter.segments[-1].capture_end()
                torch.cuda.current_stream().wait_stream(stream)
                self.chains[b] = (cutter.segments, cutter.cuts)
        finally:
            for blk, (d, hook) in zip(blocks, saved, strict=True):
                blk.dispatcher, blk.load_hook = d, hook
        torch.cuda.synchronize()

    def _replay(self, bucket: int, b: int) -> None:
        segments, cuts = self.chains[bucket]
        views = self._views.get((bucket, b))
        if views is None:  # NOTE: the slices of a step's batch size, made once, not per layer
            views = self._views[(bucket, b)] = [
                (c.layer, c.x[:b], c.ids[:b], c.ids_host[:b], c.weights_host[:b], c.routed[:b]) for c in cuts
            ]
        take = self.dispatcher.take_deferred  # issue 14h2: --cpu-defer-experts
        held: Pending | None = None  # issue 14h2: the previous MoE layer's held-back sum
        clock, timings, hook, ready = time.perf_counter, self.timings, self.load_hook, self.ready
        submit, stage = self.dispatcher.submit, self.dispatcher.stage
        for seg, (layer, x, ids, ids_host, weights_host, routed) in zip(segments, views):
            t0 = clock()
            seg.replay()
            stage(layer, x)  # the hidden states' copy to the server, queued behind the segment
            ready.record()
            if hook is not None:
                hook(layer, ids)
            ready.synchronize()  # the routing is on the host now
            t1 = clock()
            pending = submit(layer, x, ids_host, weights_host, out=routed)
            t2 = clock()
            pending.wait()
            # --- issue 14h2: --cpu-defer-experts (coordinator/deferral.py): the layer before's
            # held-back sum joins this layer's routed output, which the next segment adds to
            # the residual stream (the eager path's Carry.after_layer) ---
            if held is not None:
                routed.add_(held.wait())
            held = take()
            # --- end issue 14h2 ---
            if timings is not None:
                timings.append((t1 - t0, t2 - t1, clock() - t2))
        if held is not None:  # issue 14h2: the last layer's own, before the final norm (Carry.finish)
            routed.add_(held.wait())
        segments[-1].replay()
