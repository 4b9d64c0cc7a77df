"""Piecewise CUDA graphs of the decode step when routed experts live on expert servers.

A remote MoE layer waits on another process, which no graph can hold, so the step is captured
as a chain of graphs cut at every MoE dispatch: segment 0 runs from the embedding to layer 0's
router, segment k from layer k-1's routed-expert output to layer k's router, the last one to
the logits. Without the cuts the coordinator's per-layer work (two RMSNorms, the qkv / o
projections, rotary + KV write, attention, the router) is ~16 kernel launches from Python,
~1.7 ms per layer eagerly against ~0.09 ms of GPU work (benchmarks/RESULTS.md).

Each cut also copies the layer's routing (``topk_ids``, ``topk_weights``) into pinned host
buffers inside the graph, so the host reads them after one event wait with no extra copy
launched from Python. Between two segments the host does the remote dispatch
(coordinator/experts/remote.py) with the segment's static MoE input and host routing, and writes the
summed answer into the static buffer the next segment reads.

NOTE: a shared expert (DeepSeek, Qwen2-MoE) runs at the start of the next segment, after the
servers answered, so it no longer overlaps with them; the eager path keeps the overlap.

The device link (expertmesh/transport/link.py; the step's pieces in coordinator/model/linked_step.py,
the host link's and the hybrid share's there too): when every MoE layer routes to one
expert server over a live link (RemoteDispatcher.link_plan), the step is ONE graph with no cuts,
captured lazily per bucket (its own pool, again for each new link). At each MoE dispatch the
graph writes the layer's hidden states, local slot ids (the dispatcher's GPU slot table; -1 for
padding rows) and weights into the link's request area and signals its flag; the server's step
graph, launched by a LinkStep, waits on that flag, computes and signals back; the Pending's wait
spins on the answer flag (a shared expert computed in between overlaps the server), copies the
answer and ORs its status into the step's error word. A copy of that word queued behind the
step is read once the step is finished (:meth:`launch` returns before: the scheduler queues
the next step first): any bit -> nothing of the step is used, the server is marked down, and
the same step runs again on the piecewise chain (its K/V writes go to the same slots).

With ``micro`` > 1 (the engine's --micro-batches; ``None``, the coordinator's default: 2 for
buckets of 4-16 rows, where two paid on a measured TCP hop with and without 100 us of added
delay each way) and a relayed TCP link that takes them, a bucket's linked step is captured as
that many micro-batches of whole rows
(CausalLM.forward_micro: one micro-batch's attention is queued while another's request is on
the wire; linked_step.Linker says how they share the areas).

Shapes: Bm largest bucket, H hidden, K top-k, V vocab.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from coordinator.model.batch import ForwardBatch
from coordinator.model.cuda_graphs import BUCKETS, DecodeGraphs, Replayed, once
from coordinator.model.dispatch import Dispatcher, Pending
from coordinator.model.kv_cache import KVCache
from coordinator.model.linked_step import LinkedStep, Linker, LinkState, LocalShare
from coordinator.model.models.base import CausalLM
from coordinator.model.models.moe import LoadHook, StepLoadHook
from expertmesh.gpu_share import ShareProbe
from expertmesh.net import device_uuid

if TYPE_CHECKING:
    from coordinator.experts.expert_conn import ServerConnection
    from coordinator.experts.remote import RemoteDispatcher
    from expertmesh.transport.client import LinkAreas

log = logging.getLogger("expertmesh.remote")

# The coordinator's default (--micro-batches auto): two micro-batches for linked steps of these
# bucket sizes. Measured at full size (Qwen3-30B-A3B, every expert on a GPU server on a second
# GPU over the TCP relay, benchmarks/RESULTS.md): two paid at 4-16 rows with and without 100 us
# of added delay each way, were even or lost at 2 (single rows: the server answers twice a layer) and
# lost 11-13% at 64 rows without delay (the GPU work no longer hides behind the wire).
AUTO_MICRO = 2
AUTO_MICRO_BUCKETS = range(4, 17)


def auto_micro(bucket: int) -> int:
    return AUTO_MICRO if bucket in AUTO_MICRO_BUCKETS else 1


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
    """Decode graphs (coordinator/model/cuda_graphs.py) cut at each MoE dispatch; ``dispatcher`` is
    the remote one the model is attached to."""

    # NOTE: decodes only: a linked step's per-layer areas and the servers' step graphs are sized
    # and tested for one token per sequence; an extend here runs eagerly, as before
    extends = False

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        max_pages_per_seq: int,
        load_hook: LoadHook | None,
        dispatcher: RemoteDispatcher,
        buckets: tuple[int, ...] = BUCKETS,
        step_load: StepLoadHook | None = None,
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
        self._link: LinkState | None = None  # the graphs of the current device link
        self._link_note = ""  # the last reason a step did not link (logged when it changes)
        self.link_pool_bytes = 0  # what the current link's graphs added to the allocator's reserve
        self._broken: LinkAreas | None = None  # a link whose capture failed: its steps go piecewise
        # "auto" links stand down while other processes compute on this GPU (expertmesh/gpu_share.py)
        self._share = (
            ShareProbe.for_device(device_uuid(dev)) if dispatcher.cluster.device_link == "auto" else None
        )
        ids = model.config.moe_layer_ids
        self._moe_index = {layer: i for i, layer in enumerate(ids)}
        # micro-batches of a linked step over a relayed link that takes them (the engine's
        # --micro-batches); 1: none, None: AUTO_MICRO's choice
        self.micro: int | None = 1
        self._local_rows = torch.arange(buckets[-1], device=dev)  # a micro-batch's logits rows
        super().__init__(model, cache, max_pages_per_seq, load_hook, buckets, step_load=step_load)

    # ------------------------------------------------------------ the device link

    def run(self, seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:  # [b, V] float32
        b = len(seqs)
        step = self.launch(seqs)
        if not step.finish():  # a linked step failed: nothing of it is used
            # NOTE: the re-run is a fresh step: it routes around the server just marked down
            # (and waits, bounded, for it to come back, as the piecewise path does after any
            # loss) instead of sending into its dead stream; its K/V writes go to the same slots
            self.dispatcher.begin_step(b)
            bucket = self.bucket(b)
            assert bucket is not None
            self._replay_piecewise(bucket, b)
            return self.logits[bucket][:b].clone()
        return step.logits.clone()

    def launch(self, seqs: list[tuple[int, int, list[int]]], feed: torch.Tensor | None = None) -> Replayed:
        """The step over the link, queued and not waited for; without a link (or refused) the
        piecewise chain, which waits for the servers layer by layer."""
        b, bucket = self._stage(seqs, feed)
        step = self._launch_linked(bucket, b)
        if step is None:  # no link, refused, or its capture failed: the piecewise chain
            self._replay_piecewise(bucket, b)
            step = Replayed(self.logits[bucket][:b])
        return step

    def _replay_piecewise(self, bucket: int, b: int) -> None:
        # NOTE: under inference mode, as an eager step's dispatch is (CausalLM.forward): the
        # host dispatch between segments runs the coordinator's own experts
        # (coordinator/experts/local.py), whose buffers an eager step may have made as
        # inference tensors. Not the linked replay: the link's areas are written by the
        # connection's thread, outside inference mode.
        with torch.inference_mode():
            self._replay(bucket, b)

    def links(self, b: int) -> bool:
        """Whether a decode step of ``b`` sequences would try the link now (the engine then
        hands it to :meth:`run` instead of its eager micro-batches: the linked graph splits
        it itself where the link takes micro-batches). Call after the dispatcher's begin_step."""
        bucket = self.bucket(b)
        if bucket is None:
            return False
        plan = self.dispatcher.link_plan(bucket)
        return plan is not None and plan[2] is not self._broken

    def _micro_for(self, lnk: LinkAreas, bucket: int, share: LocalShare | None) -> int:
        """The micro-batches of this step: the engine's count (or AUTO_MICRO's) where the link
        takes that many, the bucket splits evenly and no in-process share computes beside the
        server; else 1."""
        m = self.micro
        if m is None:
            m = auto_micro(bucket)
        if m <= 1 or lnk.micro < m or share is not None or bucket % m:
            return 1
        return m

    def _launch_linked(self, bucket: int, b: int) -> Replayed | None:
        """The step over the device link, queued; None when it does not run there. Its
        ``finish`` reads the step's error word (a copy queued behind it: the word itself is the
        next step's once that runs) and holds the link's lock until then: the channel's close
        waits for it before the areas go."""
        d = self.dispatcher
        plan = d.link_plan(bucket)
        if plan is None:
            return None
        server, conn, lnk = plan
        why = self._share.shared() if self._share is not None else ""
        if why:
            self._note(conn, why)
            return None
        with lnk.lock:  # NOTE: the channel's close() waits for it before unmapping the answer area
            if lnk.closed or lnk.ans is None or lnk is self._broken:
                return None
            share, why = self._local_share(d)
            if why:
                self._note(conn, why)
                return None
            st = self._link
            if st is None or st.link is not lnk:  # a new link: the old one's graphs go
                if st is not None:
                    st.close()
                self._link = None
                try:
                    st = self._link = LinkState.new(lnk, self.cache.k.device, self.buckets[-1])
                except RuntimeError as e:  # NOTE: the host link's mapping (CudaIpcError), CUDA errors
                    log.error("%s: cannot map the link's areas: %s; this link is not used", conn.spec.name, e)
                    self._broken = lnk
                    return None
                self.link_pool_bytes = 0
            key = None if share is None else share.key
            if st.local_key != key:  # the in-process member's weights moved: capture again
                st.steps.clear()
                st.local_key = key
            micro = self._micro_for(lnk, bucket, share)
            linked = st.steps.get((bucket, micro))
            if linked is None:
                dev = self.cache.k.device
                torch.cuda.empty_cache()  # NOTE: the capture empties it too: measure from the same state
                reserved = torch.cuda.memory_reserved(dev)
                try:
                    linked = st.steps[(bucket, micro)] = self._capture_linked(st, bucket, share, micro)
                except RuntimeError as e:  # NOTE: torch's CUDA errors (capture, out of memory)
                    log.error("%s: cannot capture the linked decode step (bucket %d): %s; this "
                              "link is not used", conn.spec.name, bucket, e)  # fmt: skip
                    self._broken, self._link = lnk, None
                    return None
                self.link_pool_bytes += torch.cuda.memory_reserved(dev) - reserved
            step = lnk.next_step
            lnk.next_step += 1
            sent = d.launch_link_step(server, conn, step, b, bucket, micro)
            if isinstance(sent, str):
                self._note(conn, sent)
                return None
            st.step.upload(step, b)
            linked.graph.replay()
            # NOTE: the server's answer is read once our side is launched: the two launches
            # overlap (at full size the round trip was ~0.3 ms of each token's host time)
            why = sent()
            if why:  # the server runs no step: our waits end at once, nothing of it is used
                assert lnk.cancel is not None  # LinkState.new set it
                lnk.cancel(step)
                self._note(conn, why)
                return None
            bits = torch.empty(1, dtype=torch.int64, pin_memory=True)
            bits.copy_(st.errors, non_blocking=True)
            routed: torch.Tensor | list[tuple[int, torch.Tensor]] | None = None
            if self.counts_load:  # NOTE: copies: the next step's replay rewrites the graph's
                if micro == 1 and linked.stacked is not None:
                    routed = linked.stacked[:, :b].clone()
                else:  # each layer's real rows, a micro-batched step's joined
                    per_layer = []
                    for j in range(0, len(linked.ids), micro):
                        parts = linked.ids[j : j + micro]
                        real = [ids[: max(0, min(ids.shape[0], b - at))] for _, ids, at in parts]
                        per_layer.append((parts[0][0], torch.cat(real)))
                    routed = per_layer
            ended = torch.cuda.Event()
            ended.record()
            lnk.lock.acquire()  # NOTE: an RLock: released by finish, on this thread
        held = [True]

        def finish() -> bool:
            if held[0]:
                held[0] = False
                try:
                    ended.synchronize()
                finally:
                    lnk.lock.release()
            code = int(bits[0])
            if code:
                log.error("%s: device-link step %d failed (error bits %d): running it again without the link",
                          conn.spec.name, step, code)  # fmt: skip
                d.link_failed(server, conn, code)
                return False
            d.linked_steps += 1
            d.linked_micro_steps += micro > 1
            self._link_note = conn.link_pause = ""
            if isinstance(routed, torch.Tensor):
                self.record_load((), b, routed)
            elif routed is not None:
                self.record_load(routed, b)
            return True

        def cancel() -> None:
            assert lnk.cancel is not None
            lnk.cancel(step)

        return Replayed(linked.logits[:b], once(finish), cancel)

    def _note(self, conn: ServerConnection, why: str) -> None:
        """A step of a live link ran without it: logged when the reason changes, and shown in
        the server's status (``expertmesh status``) until a step links again."""
        conn.link_pause = why
        if why != self._link_note:
            log.info("%s: decode step without the link: %s", conn.spec.name, why)
            self._link_note = why

    def _local_share(self, d: RemoteDispatcher) -> tuple[LocalShare | None, str]:
        """The in-process member's share of a hybrid linked step (None: no share), or why this
        step cannot link."""
        member = d.link_local()
        if member is None:
            return None, ""
        worker = member.worker
        inner = getattr(worker.backend, "inner", worker.backend)
        if type(inner).__name__ != "TritonExpertBackend":
            return None, f"the in-process experts' {worker.backend.name} backend has no capturable MoE"
        live = worker.slots.live
        weights = [(live.layers[i].w13, live.layers[i].w2) for i in worker.slots.moe_layers]
        key = (live.generation, tuple((a.data_ptr(), b.data_ptr()) for a, b in weights))
        return LocalShare(inner, d.link_local_table, weights, key), ""

    def _micro_batches(self, bucket: int, micro: int) -> list[ForwardBatch]:
        """``bucket``'s static step metadata as ``micro`` micro-batches of whole rows (views)."""
        rows, p = bucket // micro, self.cache.page_size
        return [
            ForwardBatch(
                input_ids=self.meta[0, m * rows : (m + 1) * rows],
                positions=self.meta[1, m * rows : (m + 1) * rows],
                write_index=self.meta[2, m * rows : (m + 1) * rows],
                chunks=(),
                logits_index=self._local_rows[:rows],
                page_table=self.table[m * rows : (m + 1) * rows],
                token_seq=self._identity[:rows],  # NOTE: a decode's: these graphs never extend
                page_size=p,
            )
            for m in range(micro)
        ]

    def _capture_linked(
        self, st: LinkState, bucket: int, share: LocalShare | None = None, micro: int = 1
    ) -> LinkedStep:
        """Captures ``bucket``'s whole step over ``st``'s link (as ``micro`` micro-batches,
        CausalLM.forward_micro, when > 1): a warm-up run first (every op once, outside any
        capture, with no flag kernel: link.py's NOTE on lazy loading), on padding metadata (K/V
        writes go to the scratch row); the step's metadata is restored."""
        blocks = self.model.moe_blocks()
        saved = [(blk.dispatcher, blk.load_hook) for blk in blocks]
        meta = self.meta.clone()
        linker = Linker(
            st,
            self.dispatcher.link_table,
            self._moe_index,
            bucket,
            self.dispatcher.cluster.timeout_s,
            share,
            micro,
        )
        graph = torch.cuda.CUDAGraph()
        try:
            for blk in blocks:
                blk.dispatcher, blk.load_hook = linker, None
            self._pad(0, self.buckets[-1])
            batch = self._batch(bucket)
            parts = self._micro_batches(bucket, micro) if micro > 1 else []

            def forward() -> torch.Tensor:
                if parts:
                    return self.model.forward_micro(parts, self.cache)
                return self.model(batch, self.cache)

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                linker.prologue()
                forward()
            stream.synchronize()
            linker.capturing = True
            # NOTE: thread_local: the cluster's threads may touch CUDA while this captures
            with torch.cuda.graph(graph, pool=st.pool, stream=stream, capture_error_mode="thread_local"):
                linker.prologue()
                logits = forward()
                stacked = None
                if micro == 1 and self.step_load is not None and linker.ids:
                    stacked = torch.stack([ids for _, ids, _ in linker.ids])  # one node more
            torch.cuda.current_stream().wait_stream(stream)
        finally:
            for blk, (disp, hook) in zip(blocks, saved, strict=True):
                blk.dispatcher, blk.load_hook = disp, hook
            self.meta.copy_(meta)
        torch.cuda.synchronize()
        return LinkedStep(graph, logits, linker.ids, stacked)

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
        take = self.dispatcher.take_deferred  # --cpu-defer-experts
        held: Pending | None = None  # the previous MoE layer's held-back sum
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
            # --- --cpu-defer-experts (coordinator/model/deferral.py): the layer before's
            # held-back sum joins this layer's routed output, which the next segment adds to
            # the residual stream (the eager path's Carry.after_layer) ---
            if held is not None:
                routed.add_(held.wait())
            held = take()
            if timings is not None:
                timings.append((t1 - t0, t2 - t1, clock() - t2))
        if held is not None:  # the last layer's own, before the final norm (Carry.finish)
            routed.add_(held.wait())
        segments[-1].replay()
