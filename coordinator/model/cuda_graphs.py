"""CUDA graphs of the in-process decode step: one graph per batch-size bucket, captured at start.

A decode step (one new token per sequence, logits of each) at batch b replays the graph of the
smallest bucket >= b. So does any other step of T <= the largest bucket tokens (a short prefill
or the extend of a cached prefix, alone or beside decodes): the graph's rows are tokens, not
sequences, and which sequence each token belongs to and which rows give logits are buffers too,
so a 64-token extend costs one replay instead of an eager step's ~14 kernel launches per layer
from Python (measured on an H200 at Qwen3-30B-A3B widths, 8 layers: ~12 ms eager for ~3 ms of
kernels). The graph reads its step metadata from static device buffers that
:meth:`DecodeGraphs.run` fills with one copy per buffer; the rows past b are padding: position
-1 (attention gives them zeros), K/V written to the cache's scratch row, logits dropped. Every
kernel of the step (attention off the page table, fused MoE) has a grid fixed by the bucket and
no host synchronisation, which is what capture needs.

The expert-load hook (EPLB) is a host callback, so it cannot sit inside a graph: the graphs keep
each MoE layer's routing ids in their static output and the hook sees the first b rows after
each replay, every layer's in one call where a step hook is given (``step_load``).

Memory: the graphs share one pool; what capture added to the caching allocator's reserve
(activations of the largest bucket, the logits of each bucket) is kept in ``pool_bytes``.

Shapes: Bm largest bucket, W page-table width, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from coordinator.model import compile_ahead
from coordinator.model.batch import ForwardBatch
from coordinator.model.dispatch import BackgroundLoad
from coordinator.model.kv_cache import KVCache
from coordinator.model.models.base import CausalLM
from coordinator.model.models.moe import LoadHook, StepLoadHook

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _held() -> bool:
    return True


@dataclass
class Replayed:
    """A decode step queued on the device (:meth:`DecodeGraphs.launch`): nothing of it was read
    back. ``logits`` ``[b, V]`` is a view of the graph's output, valid until the next launch.
    ``finish`` (once, after the step's end: it waits for it) says whether its results hold; a
    linked step that failed there had nothing of it used. ``cancel`` ends its waits on a server
    at once (its results are not wanted)."""

    logits: torch.Tensor
    finish: Callable[[], bool] = _held
    cancel: Callable[[], None] | None = None


def once(fn: Callable[[], bool]) -> Callable[[], bool]:
    """``fn`` run on the first call only; every call answers its result."""
    done: list[bool] = []

    def call() -> bool:
        if not done:
            done.append(fn())
        return done[0]

    return call


def upload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Host ``src`` into device ``dst`` without waiting: through pinned memory, which the caching
    host allocator keeps until the copy ran. Why: a copy from pageable memory waits for the
    stream, i.e. for a step still running there (the scheduler queues the next step behind it)."""
    if dst.device.type != "cuda":
        dst.copy_(src)
        return
    dst.copy_(src.pin_memory(), non_blocking=True)


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        max_pages_per_seq: int,
        load_hook: LoadHook | None,
        buckets: tuple[int, ...] = BUCKETS,
        load: BackgroundLoad | None = None,
        capture: bool = True,
        warmed: Callable[[int], None] | None = None,
        step_load: StepLoadHook | None = None,
    ) -> None:
        """``load``: the experts still being read (LocalDispatcher's background load): every
        bucket's step runs once first, on the weights as they are, so that its kernels compile
        meanwhile (each bucket once the kernel compile helper has compiled its kernels, where
        one runs: coordinator/model/compile_ahead.py); capture waits for the load. ``capture=False``:
        every bucket's step runs once, ``warmed(bucket)`` after each, and nothing is captured
        (the helper's own run). ``step_load``: takes a replay's routing ids in one call instead
        of ``load_hook``'s one per MoE layer."""
        assert buckets and list(buckets) == sorted(buckets) and buckets[0] > 0, f"{buckets=}"
        self.model, self.cache, self.buckets = model, cache, buckets
        self.load_hook, self.step_load = load_hook, step_load
        dev = cache.k.device
        bm, self.width = buckets[-1], max_pages_per_seq
        # ids, positions, write rows, the rows whose logits are wanted (the last of each sequence)
        self.meta = torch.zeros(4, bm, dtype=torch.long, device=dev)
        self.meta[3] = torch.arange(bm)
        self.table = torch.zeros(bm, self.width, dtype=torch.int32, device=dev)  # [Bm, W]
        self.token_seq = torch.arange(bm, dtype=torch.int32, device=dev)  # [Bm] page-table row of each token
        self._identity = torch.arange(bm, dtype=torch.int32, device=dev)  # a decode's token_seq
        self._seq_identity = True  # whether token_seq holds it
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> [bucket, V] static output
        self.routed: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> layer -> [bucket, K] ids
        self.stacked: dict[int, torch.Tensor] = {}  # bucket -> [L_moe, bucket, K] the same, by the graph
        if not capture:
            self._pad(0, bm)
            for b in reversed(buckets):  # NOTE: the order of the warm-up below
                self._warm(b)
                torch.cuda.synchronize()
                if warmed is not None:
                    warmed(b)
            return
        if load is not None:
            self._pad(0, bm)
            blocks = model.moe_blocks()
            hooks = [blk.load_hook for blk in blocks]
            try:
                for blk in blocks:  # NOTE: no expert counts from steps that serve nobody
                    blk.load_hook = None
                with load.early():
                    for b in reversed(buckets):
                        compile_ahead.wait_for(b)
                        self._warm(b)
            finally:
                for blk, hook in zip(blocks, hooks, strict=True):
                    blk.load_hook = hook
            load.wait()
        torch.cuda.empty_cache()  # capture empties it too: measure from the same state
        reserved = torch.cuda.memory_reserved(dev)
        self._capture_all()
        self.pool_bytes = torch.cuda.memory_reserved(dev) - reserved

    @property
    def counts_load(self) -> bool:
        """Whether a replay hands its routing to a load hook."""
        return self.load_hook is not None or self.step_load is not None

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.meta[0, :b],
            positions=self.meta[1, :b],
            write_index=self.meta[2, :b],
            chunks=(),
            logits_index=self.meta[3, :b],
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
                    blk.load_hook = routed.__setitem__ if self.counts_load else None
                batch = self._warm(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[b] = self.model(batch, self.cache)
                    if self.step_load is not None and routed:
                        self.stacked[b] = torch.stack(list(routed.values()))  # one node more
                self.graphs[b], self.routed[b] = graph, routed
        finally:
            for blk, hook in zip(blocks, hooks, strict=True):
                blk.load_hook = hook
        torch.cuda.synchronize()

    def _warm(self, b: int) -> ForwardBatch:
        """One step of bucket ``b`` off the capture (Triton compiles, cuBLAS picks kernels)."""
        batch = self._batch(b)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(batch, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        return batch

    def _pad(self, start: int, end: int) -> None:
        self.meta[0, start:end] = 0
        self.meta[1, start:end] = -1
        self.meta[2, start:end] = self.cache.scratch_row

    def bucket(self, b: int) -> int | None:
        return next((x for x in self.buckets if x >= b), None)

    # NOTE: every token of a step replayed here reads the cache through the page table (the
    # Triton kernels), so a graph computes extends as well as decodes; a subclass whose steps
    # leave the process between pieces (remote_graphs.py) replays decodes only
    extends = True

    def run(self, seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:  # [b, V] float32
        """seqs: (new token id, tokens already cached, page table) per sequence."""
        return self.run_tokens([([tok], past, pages) for tok, past, pages in seqs])

    def launch(self, seqs: list[tuple[int, int, list[int]]], feed: torch.Tensor | None = None) -> Replayed:
        """Queues a decode step (``seqs`` as :meth:`run`'s) and returns without waiting for it.
        ``feed`` ``[b]`` int64 on the device: the step's token ids instead of the host's (the
        samples of the step queued before, unknown to the host yet)."""
        b, bucket = self._stage(seqs, feed)
        self._replay(bucket, b)
        return Replayed(self.logits[bucket][:b])

    def _stage(self, seqs: list[tuple[int, int, list[int]]], feed: torch.Tensor | None) -> tuple[int, int]:
        """A decode step's metadata into the static buffers, ``feed``'s token ids over the
        host's; (sequences, bucket)."""
        b = len(seqs)
        bucket = self.bucket(b)
        assert bucket is not None, f"{b=} > largest bucket {self.buckets[-1]}"
        self._fill(seqs, bucket)
        if feed is not None:
            self.meta[0, :b].copy_(feed)
        return b, bucket

    def run_tokens(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:  # [B, V] float32
        """seqs: (new token ids, tokens already cached, page table) per sequence, T tokens in
        all; the logits of each sequence's last new token."""
        t = sum(len(toks) for toks, _, _ in seqs)
        bucket = self.bucket(t)
        assert bucket is not None, f"{t=} > largest bucket {self.buckets[-1]}"
        self._fill_tokens(seqs, bucket)
        self._replay(bucket, t)
        # NOTE: a copy, since the next replay overwrites the graph's output
        return self.logits[bucket][: len(seqs)].clone()

    def _fill(self, seqs: list[tuple[int, int, list[int]]], bucket: int) -> None:
        self._fill_tokens([([tok], past, pages) for tok, past, pages in seqs], bucket)

    def _fill_tokens(self, seqs: list[tuple[list[int], int, list[int]]], bucket: int) -> None:
        """The step's metadata into the static buffers: one host-to-device copy per buffer
        (a decode's token-to-sequence map is the identity, kept on the device: no copy).
        Padding rows: token 0 at position -1, K/V to the scratch row."""
        p = self.cache.page_size
        need = [-(-(past + len(toks)) // p) for toks, past, _ in seqs]
        w = max(need)
        assert w <= self.width, f"a sequence needs {w} pages, the graphs hold {self.width}"
        decode = len(seqs) == sum(len(toks) for toks, _, _ in seqs)
        if decode:  # the hot path: one token per sequence
            ids = [toks[0] for toks, _, _ in seqs]
            pos = [past for _, past, _ in seqs]
            rows = [pages[past // p] * p + past % p for _, past, pages in seqs]
            last = list(range(len(seqs)))
        else:
            ids, pos, rows, last, seq = [], [], [], [], []
            for i, (toks, past, pages) in enumerate(seqs):
                ids += toks
                pos += range(past, past + len(toks))
                rows += [pages[q // p] * p + q % p for q in range(past, past + len(toks))]
                seq += [i] * len(toks)
                last.append(len(ids) - 1)
        pad = bucket - len(ids)
        host = torch.tensor(
            [
                ids + [0] * pad,
                pos + [-1] * pad,
                rows + [self.cache.scratch_row] * pad,
                last + [0] * (bucket - len(last)),
            ],
            dtype=torch.long,
        )
        table = torch.zeros(len(seqs), w, dtype=torch.int32)
        for i, (_, _, pages) in enumerate(seqs):
            table[i, : need[i]] = torch.tensor(pages[: need[i]], dtype=torch.int32)
        upload(self.meta[:, :bucket], host)
        if not decode:
            upload(self.token_seq[:bucket], torch.tensor(seq + [0] * pad, dtype=torch.int32))
            self._seq_identity = False
        elif not self._seq_identity:  # back to the identity after an extend: a device copy
            self.token_seq.copy_(self._identity)
            self._seq_identity = True
        upload(self.table[: len(seqs), :w], table)

    def _replay(self, bucket: int, b: int) -> None:
        self.graphs[bucket].replay()
        self.record_load(self.routed[bucket].items(), b, self.stacked.get(bucket))

    def record_load(
        self, routed: Iterable[tuple[int, torch.Tensor]], b: int, stacked: torch.Tensor | None = None
    ) -> None:
        """A replayed step's routing (``[(layer, [bucket, K] ids)]``, every MoE layer in order)
        to the load hooks: its first ``b`` rows; ``stacked``: the same ``[L_moe, bucket, K]``
        stacked by the graph itself, taken by ``step_load`` as it is (one host call a step)."""
        if self.step_load is not None and stacked is not None:
            self.step_load(stacked[:, :b])
            return
        routed = list(routed)
        if self.step_load is not None and routed:
            self.step_load(torch.stack([ids for _, ids in routed])[:, :b])
        elif self.load_hook is not None:
            for layer, ids in routed:
                self.load_hook(layer, ids[:b])
