"""The expert server's side of the device link (expertmesh/transport/link.py): one CUDA graph
per decode step over every MoE layer of the model.

Why: with a graph per layer (gpu_server/graphs.py) each remote layer still costs the server's
host ~150 us (decode, check, launch, stream sync) on the critical path of the coordinator's
layer loop. Here the host launches ONE graph per step, before the coordinator's step starts;
per MoE layer ``i`` (its position among the model's MoE layers) the graph

1. waits for the coordinator's request flag (``link.wait``, reading its area over NVLink),
2. takes the request into static tensors of its own (:func:`take_route`, one launch): slot
   ids outside ``[-1, S)`` become -1 and put ``ERR_BAD_SLOT`` into the step's errors word, the
   answer's status gets that word, each slot's token count is added up on the GPU, and the
   hidden states are copied,
3. runs the fused MoE (the same Triton kernels as graphs.py) straight into the answer area,
4. signals its answer flag (``link.signal``), which the coordinator's graph waits for.

A wait that times out (a coordinator that died mid-step) marks the step aborted: the rest of
the graph runs through without waiting, so the server is never stuck longer than one timeout.
After the last layer the graph copies the step's errors word and the token counts to pinned
host memory; the host reads them at the next step (or when the link closes) for the stats and
a log line.

One graph per (bucket ``Tb``, wait timeout) for the live placement generation, captured on
first use (every kernel runs once eagerly first, against scratch areas whose waits return at
once: link.py's NOTE on lazy module loading), in a memory pool of its own. A step for another
generation drops them all (the graphs hold the old weight tensors' addresses); a new mapped
request area means a new :class:`LinkGraphs` (one per fast-path channel).

Shapes: R rows of the areas, Tb bucket, H hidden, K top-k, S slots of a layer, L MoE layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from expertmesh.errors import InvalidRequest, Unavailable
from expertmesh.experts import ExpertBackend
from expertmesh.transport import link
from expertmesh.transport.link_layout import StepReport as StepReport
from expertmesh.worker import memory
from gpu_server.backend import TritonExpertBackend
from gpu_server.kernels import fused_moe

MAX_TIMEOUT_MS = 600_000
Weights = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per MoE layer: w13 [S, 2I, H], w2 [S, H, I]


class LinkBroken(Unavailable):
    """A step graph could not be captured: this link refuses every later step (the coordinator
    keeps the piecewise path)."""


# ---------------------------------------------------------------------------- one layer


@triton.jit(do_not_specialize=["n", "slots", "nx"])
def _take_kernel(
    src_ids,
    src_w,
    dst_ids,
    dst_w,
    err_ptr,
    status_ptr,
    counts_ptr,
    n,
    slots,
    src_x,
    dst_x,
    nx,
    BLOCK: tl.constexpr,
    XBLOCK: tl.constexpr,
):
    # NOTE: each branch names its own variables (compiled Triton types a name once per branch)
    pid = tl.program_id(0)
    if pid == 0:  # the routing: n = Tb * K <= 64 * 64 pairs, one program (its errors word)
        r_offs = tl.arange(0, BLOCK)
        r_m = r_offs < n
        ids = tl.load(src_ids + r_offs, mask=r_m, other=-1, volatile=True)
        w = tl.load(src_w + r_offs, mask=r_m, other=0.0, volatile=True)
        bad = r_m & ((ids < -1) | (ids >= slots))
        ids = tl.where(bad, -1, ids)
        tl.store(dst_ids + r_offs, ids, mask=r_m)
        tl.store(dst_w + r_offs, w, mask=r_m)
        # counts[0] collects the -1 pairs: no branch per pair
        tl.atomic_add(counts_ptr + ids + 1, tl.full([BLOCK], 1, tl.int64), mask=r_m)
        nbad = tl.sum(bad.to(tl.int32), axis=0)
        err = tl.load(err_ptr) | tl.where(nbad > 0, 2, 0).to(tl.int64)  # ERR_BAD_SLOT
        tl.store(err_ptr, err)
        tl.store(status_ptr, err)
    else:  # the hidden states, XBLOCK elements a program
        x_offs = (pid - 1) * XBLOCK + tl.arange(0, XBLOCK)
        x_m = x_offs < nx
        tl.store(dst_x + x_offs, tl.load(src_x + x_offs, mask=x_m, volatile=True), mask=x_m)


XBLOCK = 2048


def take_route(
    src_ids: torch.Tensor,  # [Tb, K] int32, the coordinator's (peer memory)
    src_w: torch.Tensor,  # [Tb, K] float32
    slots: int,  # S of the layer
    ids: torch.Tensor,  # [Tb, K] int32, ours
    w: torch.Tensor,  # [Tb, K] float32, ours
    errors: torch.Tensor,  # [1] int64: the step's ERR_* bits
    status: torch.Tensor,  # [1] int64: the answer's status word
    counts: torch.Tensor,  # [S' + 1] int64, S' >= S: tokens per slot + 1 (index 0: id -1)
    src_x: torch.Tensor,  # [Tb, H], the coordinator's
    x: torch.Tensor,  # [Tb, H], ours
) -> None:
    """Takes a layer's request into our own tensors: the routing into ``ids``/``w`` with ids
    outside ``[-1, slots)`` made -1 (never an out-of-bounds read in the MoE), ``ERR_BAD_SLOT``
    ORed into ``errors`` when there was one, ``errors`` written into ``status``, each slot's
    pairs counted; the hidden states into ``x``. One launch (a graph node fewer than a
    separate copy), capturable."""
    n, nx = ids.numel(), x.numel()
    assert src_ids.shape == ids.shape == w.shape == src_w.shape and counts.numel() > slots, (
        f"{src_ids.shape=} {ids.shape=} {counts.shape=} {slots=}"
    )
    assert src_x.shape == x.shape and src_x.dtype == x.dtype and src_x.is_contiguous(), (
        f"{src_x.shape=} {x.shape=}"
    )
    assert link.ERR_BAD_SLOT == 2, "the kernel writes the constant"
    block = max(16, triton.next_power_of_2(n))
    grid = (1 + triton.cdiv(nx, XBLOCK),)
    _take_kernel[grid](
        src_ids, src_w, ids, w, errors, status, counts, n, slots, src_x, x, nx, BLOCK=block, XBLOCK=XBLOCK
    )


def moe_into(inner: ExpertBackend, x, w13, w2, ids, w, out: torch.Tensor) -> None:
    """``out [Tb, H]`` = the MoE of ``x [Tb, H]`` (the Triton kernels write it in place)."""
    if w13.shape[0] == 0:  # no slot of this layer here: every id was -1
        out.zero_()
    elif isinstance(inner, TritonExpertBackend):
        cfg = inner.table.lookup(x.shape[1], w2.shape[2], x.shape[0], ids.shape[1], w13.shape[0])
        fused_moe(x, w13, w2, ids, w, config=cfg, out=out)
    else:  # the plain torch backend: CPU tests (not capturable)
        out.copy_(inner.forward(x, w13, w2, ids, w))


@dataclass
class StepInputs:
    """A bucket's static tensors: the routing and hidden states each layer copies in."""

    x: torch.Tensor  # [Tb, H]
    ids: torch.Tensor  # [Tb, K] int32
    w: torch.Tensor  # [Tb, K] float32

    @classmethod
    def new(
        cls, bucket: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device
    ) -> StepInputs:
        return cls(
            torch.zeros(bucket, hidden, dtype=dtype, device=device),
            torch.full((bucket, top_k), -1, dtype=torch.int32, device=device),
            torch.zeros(bucket, top_k, dtype=torch.float32, device=device),
        )


@dataclass
class Words:
    """The step's device words: ``step`` ``[1]`` (StepWord's), ``abort`` and ``errors``."""

    step: torch.Tensor
    abort: torch.Tensor
    errors: torch.Tensor


def run_layer(
    inner: ExpertBackend,
    req: link.RequestViews,
    ans: link.AnswerViews,
    words: Words,
    index: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    st: StepInputs,
    counts: torch.Tensor,  # [S' + 1] int64
    timeout_s: float,
    max_polls: int | None = None,  # off the GPU only (link.wait)
) -> None:
    """One MoE layer of a linked step, queued on the current stream (the graph's content)."""
    tb = st.x.shape[0]
    link.wait(req.flag, words.step, index, words.abort, words.errors, timeout_s, max_polls)
    take_route(
        req.ids[:tb],
        req.w[:tb],
        w13.shape[0],
        st.ids,
        st.w,
        words.errors,
        ans.status,
        counts,
        req.x[:tb],
        st.x,
    )
    moe_into(inner, st.x, w13, w2, st.ids, st.w, ans.out[:tb])
    link.signal(ans.flag, words.step, index)


# ---------------------------------------------------------------------------- the step graphs


# the token counts are folded into a report every this many steps (and at a new generation or
# the link's close): the fold (a copy, a subtraction, a slice per layer here and an addition per
# layer in the worker) was most of a step's host launch time, on the coordinator's critical
# path; the counts are cumulative on the GPU, so folding later loses none
FOLD_EVERY = 16


class LinkGraphs:
    """One fast-path channel's step graphs over its mapped request area and its own answer
    area (:attr:`answer`, shared with the coordinator). Calls come from one thread at a time
    (the channel's, under the worker's compute lock)."""

    def __init__(
        self,
        inner: ExpertBackend,
        request: torch.Tensor,  # uint8: the coordinator's request area, mapped on our device
        rows: int,  # R
        hidden: int,
        top_k: int,
        dtype: torch.dtype,
        buckets: Sequence[int],
        # uint8 on our device: the area to answer in (a relay's mapped host area,
        # expertmesh/transport/tcp_relay.py); None: one of our own, shared with the coordinator
        answer: torch.Tensor | None = None,
    ) -> None:
        self.inner, self.device = inner, request.device
        self.rows, self.hidden, self.top_k, self.dtype = rows, hidden, top_k, dtype
        self.buckets = tuple(b for b in buckets if b <= rows)
        need = link.request_bytes(rows, hidden, top_k, dtype)
        if request.dtype != torch.uint8 or request.numel() < need:
            raise ValueError(
                f"the request area holds {request.numel()} bytes, {rows} rows of H={hidden} "
                f"K={top_k} {dtype} need {need}"
            )
        self.req = link.RequestViews.of(request, rows, hidden, top_k, dtype)
        need = link.answer_bytes(rows, hidden, dtype)
        if answer is not None and (
            answer.dtype != torch.uint8 or answer.numel() < need or answer.device != self.device
        ):
            raise ValueError(
                f"the answer area holds {answer.numel()} bytes on {answer.device}, need {need} on {self.device}"
            )
        self.answer = link.new_area(need, self.device) if answer is None else answer
        # a relayed link's areas (set by the worker's open_link) take micro-batched steps: the
        # relay hands their requests over one at a time into the first rows (relay.c); over the
        # device link the coordinator's area holds them in other rows, which this does not read
        self.relayed = False
        self.ans = link.AnswerViews.of(self.answer, rows, hidden, dtype)
        if self.device.type == "cuda":
            link.warm_up(self.device)  # NOTE: the link's own kernels loaded before anything spins
        self.step = link.StepWord(self.device)
        self.words = Words(
            self.step.step,
            torch.full((1,), -1, dtype=torch.int64, device=self.device),  # no step aborted yet
            torch.zeros(1, dtype=torch.int64, device=self.device),
        )
        # a coordinator whose stream ended mid-step: its step's waits end now, not at their timeout
        self._cancel = link.Canceller(self.words.abort) if self.device.type == "cuda" else None
        self.generation: int | None = None
        self.broken = ""  # why a capture failed: every later step is refused
        self.last_step = -1
        self.logged: set[str] = set()  # what the worker has logged of this link (once each)
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}  # (Tb, timeout ms, micro) ->
        self._keep: tuple = ()  # the generation's weights: the graphs read their addresses
        self._pool: Any = None
        self._done = torch.cuda.Event() if self.device.type == "cuda" else None
        self._launched = False  # a replay whose report is not collected yet
        pin = self.device.type == "cuda"
        self._report = torch.zeros(2, dtype=torch.int64, pin_memory=pin)  # (step, errors)
        self._report_np = self._report.numpy()  # NOTE: a view: reads without torch's per-call cost
        self.fold_every = FOLD_EVERY
        self._unfolded = 0  # collected replays whose counts no report carried yet
        self._counts = torch.zeros(0, 1, dtype=torch.int64, device=self.device)  # [L, S' + 1]
        self._counts_host = torch.zeros(0, 1, dtype=torch.int64, pin_memory=pin)
        self._folded = np.zeros((0, 1), dtype=np.int64)
        self._slots: list[int] = []  # S of each layer of the generation

    # ------------------------------------------------------------ per step

    def launch(
        self,
        generation: int,
        weights: Weights,
        bucket: int,
        step: int,
        rows: int,
        timeout_ms: int,
        micro: int = 1,
    ) -> StepReport | None:
        """Replays the step graph of (``bucket``, ``generation``) for step ``step`` with
        ``rows`` real rows (captured first if new) and returns the report of the replays
        finished since the last one (None: nothing new). The caller checked ``bucket`` against
        :attr:`buckets`, ``rows <= bucket`` and the generation against the live one.
        ``micro`` > 1 (a relayed link): ``micro`` requests of ``bucket`` rows per MoE layer,
        request ``i * micro + m`` computed with layer ``i``'s weights."""
        self.check(bucket, step, timeout_ms, micro)
        assert bucket in self.buckets and 0 < rows <= bucket and step > self.last_step, (
            f"{bucket=} {self.buckets=} {rows=} {step=} {self.last_step=}"
        )
        # NOTE: blocks only while the last replay still runs (StepWord.set would wait for it
        # anyway); bounded, its waits time out
        report = self.collect()
        if generation != self.generation:
            if self._unfolded:  # the old generation's last counts, before its arrays go
                report = StepReport(self.last_step, 0 if report is None else report.errors, self._fold())
            self._retire(generation, weights)
        key = (bucket, timeout_ms, micro)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key, bucket, timeout_ms / 1e3)
        self.step.set(step, rows)
        graph.replay()
        self.step.replayed()
        assert self._done is not None
        self._done.record()
        self._launched, self.last_step = True, step
        return report

    def cancel(self) -> None:
        """Ends the last launched step's waits at once (any thread): its coordinator is gone."""
        if self._cancel is not None and self.last_step >= 0:
            self._cancel(self.last_step)

    def check(self, bucket: int, step: int, timeout_ms: int, micro: int = 1) -> None:
        """The refusals of a link step that depend on this link (typed errors; the worker
        checks drain and generation)."""
        if self.broken:
            raise LinkBroken(self.broken)
        if micro > 1 and not self.relayed:
            raise InvalidRequest("micro-batched link steps run over a relayed link only")
        if bucket not in self.buckets:
            raise InvalidRequest(f"bucket {bucket} is not one of this link's buckets {self.buckets}")
        if step <= self.last_step:
            raise InvalidRequest(
                f"link step {step} does not follow step {self.last_step}: steps must increase"
            )
        if not 0 < timeout_ms <= MAX_TIMEOUT_MS:
            raise InvalidRequest(f"link step timeout {timeout_ms} ms outside (0, {MAX_TIMEOUT_MS}]")

    def collect(self, fold: bool = False) -> StepReport | None:
        """The report of the last replay, once (None: none since the last report), with the
        token counts since the last fold every :attr:`fold_every` steps or when ``fold``. Waits
        for that replay to finish: nothing of ours spins afterwards (captures need that,
        link.py's NOTE), and it is bounded (the graph's waits time out)."""
        if not self._launched or self._done is None:
            return None
        self._done.synchronize()
        self._launched = False
        self._unfolded += 1
        counts = self._fold() if fold or self._unfolded >= self.fold_every else []
        return StepReport(int(self._report_np[0]), int(self._report_np[1]), counts)

    def _fold(self) -> list[np.ndarray]:
        """The pairs per slot of the replays since the last fold (they all finished)."""
        snap = self._counts_host.numpy().copy()  # [L, S' + 1]
        delta, self._folded = snap - self._folded, snap
        self._unfolded = 0
        return [delta[i, 1 : s + 1] for i, s in enumerate(self._slots)]

    def close(self) -> StepReport | None:
        """Waits for the last replay, drops the graphs; the last report, with every count not
        reported yet."""
        report = self.collect(fold=True)
        if report is None and self._unfolded:
            report = StepReport(self.last_step, 0, self._fold())
        self._drop()
        return report

    # ------------------------------------------------------------ graphs

    def _drop(self) -> None:
        for g in self._graphs.values():
            g.reset()
        self._graphs.clear()
        self._keep = ()
        self._pool = None

    def _retire(self, generation: int, weights: Weights) -> None:
        """A new placement generation: the old graphs go (the caller collected their report)."""
        self._drop()
        self.generation = generation
        self._keep = tuple(weights)
        self._slots = [w13.shape[0] for w13, _ in weights]
        shape = (len(self._slots), max(self._slots, default=0) + 1)
        self._counts = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self._counts_host = torch.zeros(shape, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._folded = np.zeros(shape, dtype=np.int64)

    def _body(
        self, req, ans, words: Words, st: StepInputs, counts: torch.Tensor, timeout_s: float, micro: int
    ) -> None:
        words.errors.zero_()
        for k in range(len(self._keep) * micro):
            w13, w2 = self._keep[k // micro]
            run_layer(self.inner, req, ans, words, k, w13, w2, st, counts[k // micro], timeout_s)

    def _capture(self, key: tuple[int, int, int], bucket: int, timeout_s: float) -> torch.cuda.CUDAGraph:
        dev = self.device
        try:
            st = StepInputs.new(bucket, self.hidden, self.top_k, self.dtype, dev)
            # warm-up: every kernel once, on scratch areas whose waits return at once (abort
            # holds the scratch step) and whose flags nobody reads
            r, h, k, dt = self.rows, self.hidden, self.top_k, self.dtype
            s_req = link.RequestViews.of(link.new_area(link.request_bytes(r, h, k, dt), dev), r, h, k, dt)
            s_ans = link.AnswerViews.of(link.new_area(link.answer_bytes(r, h, dt), dev), r, h, dt)
            zero = torch.zeros(1, dtype=torch.int64, device=dev)
            scratch = Words(zero, zero.clone(), zero.clone())
            s_counts = torch.zeros_like(self._counts)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                self.step.copy_in()
                self._body(
                    s_req, s_ans, scratch, st, s_counts, timeout_s, key[2]
                )  # (the copies out need no module)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # NOTE: thread_local: the server's other threads may use CUDA meanwhile
            with (
                memory.capturing(),
                torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"),
            ):
                self.step.copy_in()
                self._body(self.req, self.ans, self.words, st, self._counts, timeout_s, key[2])
                self._counts_host.copy_(self._counts, non_blocking=True)
                self._report[0:1].copy_(self.words.step, non_blocking=True)
                self._report[1:2].copy_(self.words.errors, non_blocking=True)
            torch.cuda.current_stream(dev).wait_stream(stream)
        except (RuntimeError, triton.CompilationError) as e:  # CUDA, capture or compile errors
            self.broken = f"the device link's step graph for {bucket} rows could not be captured: {e}"
            with contextlib.suppress(RuntimeError):
                self._drop()
            raise LinkBroken(self.broken) from e
        self._graphs[key] = graph
        return graph
