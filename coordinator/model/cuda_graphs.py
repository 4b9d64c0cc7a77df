"""CUDA graphs of the in-process decode step: one graph per batch-size bucket, captured at start.

A decode step (one new token per sequence, logits of each) at batch b replays the graph of the
smallest bucket >= b. The graph reads its step metadata from static device buffers that
:meth:`DecodeGraphs.run` fills with one copy per buffer; the rows past b are padding: position
-1 (attention gives them zeros), K/V written to the cache's scratch row, logits dropped. Every
kernel of the step (attention off the page table, fused MoE) has a grid fixed by the bucket and
no host synchronisation, which is what capture needs.

The expert-load hook (EPLB) is a host callback, so it cannot sit inside a graph: the graphs keep
each MoE layer's routing ids in their static output and the hook sees the first b rows after
each replay.

Memory: the graphs share one pool; what capture added to the caching allocator's reserve
(activations of the largest bucket, the logits of each bucket) is kept in ``pool_bytes``.

Shapes: Bm largest bucket, W page-table width, V vocab.
"""

from __future__ import annotations

import torch

from coordinator.model.batch import ForwardBatch
from coordinator.model.kv_cache import KVCache
from coordinator.model.models.base import CausalLM
from coordinator.model.models.moe import LoadHook

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        max_pages_per_seq: int,
        load_hook: LoadHook | None,
        buckets: tuple[int, ...] = BUCKETS,
    ) -> None:
        assert buckets and list(buckets) == sorted(buckets) and buckets[0] > 0, f"{buckets=}"
        self.model, self.cache, self.buckets = model, cache, buckets
        self.load_hook = load_hook
        dev = cache.k.device
        bm, self.width = buckets[-1], max_pages_per_seq
        self.meta = torch.zeros(3, bm, dtype=torch.long, device=dev)  # ids, positions, write rows
        self.table = torch.zeros(bm, self.width, dtype=torch.int32, device=dev)  # [Bm, W]
        self.token_seq = torch.arange(bm, dtype=torch.int32, device=dev)
        self.logits_index = torch.arange(bm, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> [bucket, V] static output
        self.routed: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> layer -> [bucket, K] ids
        torch.cuda.empty_cache()  # capture empties it too: measure from the same state
        reserved = torch.cuda.memory_reserved(dev)
        self._capture_all()
        self.pool_bytes = torch.cuda.memory_reserved(dev) - reserved

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.meta[0, :b],
            positions=self.meta[1, :b],
            write_index=self.meta[2, :b],
            chunks=(),
            logits_index=self.logits_index[:b],
            page_table=self.table[:b],
            token_seq=self.token_seq[:b],
            page_size=self.cache.page_size,
        )

    def _capture_all(self) -> None:
        self._pad(0, self.buckets[-1])
        blocks = self.model.moe_blocks()
        hooks = [blk.load_hook for blk in blocks]
        pool = torch.cuda.graph_pool_handle()
        try:
            for b in reversed(self.buckets):  # largest first: the smaller ones reuse its pool
                routed: dict[int, torch.Tensor] = {}
                for blk in blocks:
                    blk.load_hook = routed.__setitem__ if self.load_hook is not None else None
                batch = self._batch(b)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
                    self.model(batch, self.cache)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[b] = self.model(batch, self.cache)
                self.graphs[b], self.routed[b] = graph, routed
        finally:
            for blk, hook in zip(blocks, hooks, strict=True):
                blk.load_hook = hook
        torch.cuda.synchronize()

    def _pad(self, start: int, end: int) -> None:
        self.meta[0, start:end] = 0
        self.meta[1, start:end] = -1
        self.meta[2, start:end] = self.cache.scratch_row

    def bucket(self, b: int) -> int | None:
        return next((x for x in self.buckets if x >= b), None)

    def run(self, seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:  # [b, V] float32
        """seqs: (new token id, tokens already cached, page table) per sequence."""
        b = len(seqs)
        bucket = self.bucket(b)
        assert bucket is not None, f"{b=} > largest bucket {self.buckets[-1]}"
        self._fill(seqs, bucket)
        self._replay(bucket, b)
        # NOTE: a copy, since the next replay overwrites the graph's output
        return self.logits[bucket][:b].clone()

    def _fill(self, seqs: list[tuple[int, int, list[int]]], bucket: int) -> None:
        """The step's metadata into the static buffers: one host-to-device copy per buffer."""
        b = len(seqs)
        p = self.cache.page_size
        need = [-(-(past + 1) // p) for _, past, _ in seqs]
        w = max(need)
        assert w <= self.width, f"a sequence needs {w} pages, the graphs hold {self.width}"
        host = torch.empty(3, bucket, dtype=torch.long)
        host[0, :b] = torch.tensor([tok for tok, _, _ in seqs])
        host[1, :b] = torch.tensor([past for _, past, _ in seqs])
        host[2, :b] = torch.tensor([pages[past // p] * p + past % p for _, past, pages in seqs])
        host[0, b:], host[1, b:], host[2, b:] = 0, -1, self.cache.scratch_row
        table = torch.zeros(b, w, dtype=torch.int32)
        for i, (_, _, pages) in enumerate(seqs):
            table[i, : need[i]] = torch.tensor(pages[: need[i]], dtype=torch.int32)
        self.meta[:, :bucket].copy_(host)
        self.table[:b, :w].copy_(table)

    def _replay(self, bucket: int, b: int) -> None:
        self.graphs[bucket].replay()
        if self.load_hook is not None:
            for layer, ids in self.routed[bucket].items():
                self.load_hook(layer, ids[:b])
