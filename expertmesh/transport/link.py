"""The device link: a decode step's per-layer hand-over between a coordinator and an expert
server on two GPUs, with no host work per layer.

Without it a remote MoE layer costs ~85 us of GPU work inside ~250-300 us of host work in two
Python processes (sync, route, send, the server's decode/check/launch, its stream sync, the
coordinator's wake-up; benchmarks/RESULTS.md). With it each side replays ONE graph
per decode step, and the graphs hand over through flags in GPU memory: one side's graph
writes its payload, then :func:`signal` publishes a flag; the other side's graph spins on that
flag with :func:`wait` (over NVLink when the flag is the peer's), then copies the payload.

Pull model: each side writes only its own area (the rule of cuda_ipc.py); the other maps it
and reads. The coordinator's *request area* holds the layer's hidden states, slot ids and
weights; the server's *answer area* its output and a status word. Both are laid out for R
rows (the coordinator's largest decode bucket); a bucket of Tb rows uses the ``[:Tb]`` prefix.

Flag values: MoE layer index ``i`` (its position among the model's MoE layers) of step ``s``
is ``s * STEP_SPAN + i + 1``; a fresh area holds 0, which no layer ever waits for. Step
numbers never repeat on a link, so a stale flag from an earlier step never matches.

A wait gives up after a timeout: it records the step in its ``abort`` word and ``ERR_TIMEOUT``
in its ``errors`` word, and every later wait of that step returns at once, so a dead peer costs
one timeout, not one per layer. A side that learns on the host that its peer is gone (its
stream ended) ends the step at once with a :class:`Canceller` (the same bits). The host reads ``errors`` after the step (the coordinator
re-runs the step without the link, the server logs it).

Spinning kernels of two processes on ONE GPU time-slice (milliseconds per hand-over): the
link is meant for two GPUs with peer access (the spinning occupies one SM of each).

NOTE: with CUDA's lazy module loading (torch's default) the first launch of a kernel loads
its module, which waits for the kernels running on the device, a spinning wait among them.
A side that launches a never-used kernel while its own graph spins only goes on when the wait
ends (or times out): :func:`warm_up` loads these kernels, and each side launches its graph's
kernels once (warm-up, capture) before any link step.

Shapes: R rows, H hidden, K top-k.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from expertmesh.transport.link_layout import ERR_BAD_SLOT as ERR_BAD_SLOT
from expertmesh.transport.link_layout import ERR_TIMEOUT as ERR_TIMEOUT
from expertmesh.transport.link_layout import STEP_SPAN as STEP_SPAN
from expertmesh.transport.link_layout import AnswerViews as AnswerViews
from expertmesh.transport.link_layout import RequestViews as RequestViews
from expertmesh.transport.link_layout import answer_bytes as answer_bytes
from expertmesh.transport.link_layout import new_area as new_area
from expertmesh.transport.link_layout import request_bytes as request_bytes


class Canceller:
    """Ends the waits of a step from the host, from any thread: writes ``abort[0] = step`` by a
    copy on a stream of its own (a copy engine's work: no kernel whose module would have to
    load while a wait spins, see the NOTE above). A wait spinning then reports ``ERR_TIMEOUT``
    and the rest of the step runs through."""

    def __init__(self, abort: torch.Tensor) -> None:
        self.abort = abort  # [1] int64, the waits' abort word
        self._src = torch.zeros(1, dtype=torch.int64, pin_memory=abort.is_cuda)
        self._stream = torch.cuda.Stream(abort.device) if abort.is_cuda else None
        self._lock = threading.Lock()

    def __call__(self, step: int) -> None:
        with self._lock:
            self._src[0] = step
            if self._stream is None:
                self.abort.copy_(self._src)
                return
            with torch.cuda.device(self.abort.device), torch.cuda.stream(self._stream):
                self.abort.copy_(self._src, non_blocking=True)
            self._stream.synchronize()


class StepWord:
    """``(step, rows)`` of the step being replayed: a pinned host pair the host sets before a
    replay and a device pair the graph fills first (:meth:`copy_in`, a copy node), as
    gpu_server/graphs.py's routing staging does. ``dev[0:1]`` is the ``step`` of
    :func:`signal` / :func:`wait`, ``dev[1:2]`` the rows."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(2, dtype=torch.int64, pin_memory=cuda)
        self._host_np = self.host.numpy()  # NOTE: a view: two torch item writes cost ~15 us a step
        self.dev = torch.zeros(2, dtype=torch.int64, device=device)
        self.step, self.rows = self.dev[0:1], self.dev[1:2]
        self._used = torch.cuda.Event() if cuda else None
        self._pending = False

    def copy_in(self) -> None:
        """Queues the upload (inside a capture: the graph's copy node)."""
        self.dev.copy_(self.host, non_blocking=True)

    def set(self, step: int, rows: int) -> None:
        """Before a replay; then :meth:`replayed` after it."""
        if self._pending and self._used is not None:
            self._used.synchronize()  # NOTE: the last replay's upload from here may still be queued
        self._host_np[0], self._host_np[1] = step, rows

    def replayed(self) -> None:
        if self._used is not None:
            self._used.record()
            self._pending = True

    def upload(self, step: int, rows: int) -> None:
        """Outside any graph: sets the pair and queues its upload on the current stream, for a
        graph that reads ``dev`` without a copy node of its own. The host pair is free again
        once that copy ran, not once the whole replay after it did: a step may be queued behind
        one still running (the scheduler's next step) without waiting for it."""
        if self._pending and self._used is not None:
            self._used.synchronize()
        self._host_np[0], self._host_np[1] = step, rows
        self.dev.copy_(self.host, non_blocking=True)
        if self._used is not None:
            self._used.record()
            self._pending = True


# ---------------------------------------------------------------------------- kernels


@triton.jit
def _fence_sys():
    # NOTE: orders this thread's (and, cumulatively, earlier kernels') memory operations at
    # system scope: the peer GPU reads our area over NVLink
    return tl.inline_asm_elementwise(
        "fence.acq_rel.sys;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


# NOTE: no specialisation on the layer index or the limit: Triton compiles a variant per value
# class (1, multiples of 16, int32 vs int64), and a variant first met while the peer spins
# loads its module then (the module's NOTE). The limit always travels biased into int64.
_BIAS = 1 << 32


@triton.jit(do_not_specialize=["index"])
def _signal_kernel(flag_ptr, step_ptr, index, SPAN: tl.constexpr, ON_GPU: tl.constexpr):
    step = tl.load(step_ptr)
    if ON_GPU:
        _fence_sys()
    tl.atomic_xchg(flag_ptr, step * SPAN + index + 1, sem="release", scope="sys")


@triton.jit(do_not_specialize=["index", "limit"])
def _wait_kernel(
    flag_ptr,
    step_ptr,
    abort_ptr,
    err_ptr,
    index,
    limit,
    SPAN: tl.constexpr,
    ON_GPU: tl.constexpr,
    AT_LEAST: tl.constexpr,
):
    # ON_GPU: ``limit`` is nanoseconds of the GPU's global timer; under the interpreter (no
    # inline assembly) it counts polls
    limit = limit - 4294967296  # _BIAS
    step = tl.load(step_ptr)
    want = step * SPAN + index + 1
    live = tl.load(abort_ptr, volatile=True) != step
    seen = tl.load(flag_ptr, volatile=True)
    waited = step * 0
    if ON_GPU:
        start = _now()
    if AT_LEAST:  # a later value of the step passes too (a micro-batched step's waits)
        ok = (seen >= want) & (seen < want - index + SPAN)
    else:
        ok = seen == want
    go = live & (ok == 0)
    while go:
        seen = tl.load(flag_ptr, volatile=True)
        if ON_GPU:
            waited = _now() - start
        else:
            waited += 1
        if AT_LEAST:
            ok = (seen >= want) & (seen < want - index + SPAN)
        else:
            ok = seen == want
        # NOTE: the abort word is re-read: the host cancels a step whose peer is gone (Canceller)
        go = (ok == 0) & (waited < limit) & (tl.load(abort_ptr, volatile=True) != step)
    if ok == 0:  # timed out, cancelled, or an earlier wait of the step did: no answer here
        tl.store(abort_ptr, step)
        tl.atomic_or(err_ptr, 1)  # ERR_TIMEOUT
    if ON_GPU:
        _fence_sys()  # acquire: what the peer wrote before its flag is visible to what follows


@triton.jit(do_not_specialize=["index", "first", "n_x", "n_ids"])
def _send_kernel(
    x_ptr,
    topk_ptr,
    w_ptr,
    table_ptr,
    rx_ptr,
    rids_ptr,
    rw_ptr,
    flag_ptr,
    word_ptr,
    index,
    first,
    n_x,
    n_ids,
    K: tl.constexpr,
    SPAN: tl.constexpr,
    ON_GPU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program: a layer's request (hidden states, slot ids, weights), then its flag, in ONE
    # kernel instead of four copies and a signal (a graph node each, per layer and step)
    step = tl.load(word_ptr)
    real = tl.load(word_ptr + 1)  # rows of the step that are not padding
    for start in range(0, n_x, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < n_x
        v = tl.load(x_ptr + o, mask=m)
        tl.store(rx_ptr + o, v.to(rx_ptr.dtype.element_ty), mask=m)
    for start in range(0, n_ids, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < n_ids
        live = m & (first + o // K < real)
        e = tl.load(topk_ptr + o, mask=live, other=0)
        sid = tl.load(table_ptr + e, mask=live, other=-1)
        tl.store(rids_ptr + o, sid, mask=m)
        tl.store(rw_ptr + o, tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32), mask=m)
    if ON_GPU:
        _fence_sys()  # each thread's own writes, before the barrier and the flag
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, step * SPAN + index + 1, sem="release", scope="sys")


@triton.jit
def _take_kernel(out_ptr, status_ptr, err_ptr, dst_ptr, add_ptr, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
    # the answer into our memory (plus the in-process share where there is one) and its status
    # bits into the step's error word: one kernel instead of a copy, an add and an OR
    pid = tl.program_id(0)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    v = tl.load(out_ptr + o, mask=m, other=0.0).to(tl.float32)
    if ADD:
        v += tl.load(add_ptr + o, mask=m, other=0.0).to(tl.float32)
    tl.store(dst_ptr + o, v.to(dst_ptr.dtype.element_ty), mask=m)
    if pid == 0:
        tl.atomic_or(err_ptr, tl.load(status_ptr, volatile=True))


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def signal(flag: torch.Tensor, step: torch.Tensor, index: int) -> None:
    """Publishes MoE layer ``index`` of step ``step[0]`` in ``flag [1] int64`` (this side's own
    area), after everything this stream did before. Capturable."""
    _signal_kernel[(1,)](flag, step, index, SPAN=STEP_SPAN, ON_GPU=_on_gpu(flag), num_warps=1)


def wait(
    flag: torch.Tensor,
    step: torch.Tensor,
    index: int,
    abort: torch.Tensor,
    errors: torch.Tensor,
    timeout_s: float,
    max_polls: int | None = None,
    at_least: bool = False,
) -> None:
    """Holds this stream until ``flag [1] int64`` (the peer's area, mapped on our device) shows
    MoE layer ``index`` of step ``step[0]`` (``at_least``: or a later index of that step: a
    micro-batched step's answers may be published two at once, each in its own rows); on timeout ``abort[0] = step[0]`` and
    ``errors[0] |= ERR_TIMEOUT``; returns at once if ``abort[0] == step[0]`` (cancelled, or an
    earlier wait of the step gave up), with ``ERR_TIMEOUT`` too unless the flag is there. ``abort`` and
    ``errors`` are int64 ``[1]`` in our own memory. Capturable. ``max_polls``: the limit off
    the GPU (the interpreter has no clock)."""
    gpu = _on_gpu(flag)
    limit = int(timeout_s * 1e9) if gpu else (max_polls if max_polls is not None else 1_000_000)
    _wait_kernel[(1,)](
        flag,
        step,
        abort,
        errors,
        index,
        limit + _BIAS,
        SPAN=STEP_SPAN,
        ON_GPU=gpu,
        AT_LEAST=at_least,
        num_warps=1,
    )


def send(
    req: RequestViews,
    rows: slice,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    table: torch.Tensor,
    word: torch.Tensor,
    index: int,
) -> None:
    """Writes MoE layer ``index``'s request into ``req``'s ``rows`` and publishes its flag, in
    one kernel: ``x [n, H]``, the server's slot of each routed expert (``table [E] int32`` at
    ``topk_ids [n, K]``; -1 for rows at or past ``word[1]``, the step's real rows, counted from
    ``rows.start``), ``topk_weights [n, K]`` as float32; ``word`` the StepWord's ``[step, rows]``.
    Capturable."""
    n, k = topk_ids.shape
    assert x.is_contiguous() and topk_ids.is_contiguous() and topk_weights.is_contiguous(), (
        "contiguous inputs"
    )
    assert x.shape[0] == n and rows.stop - rows.start == n, f"{x.shape=} {topk_ids.shape=} {rows=}"
    rx, rids, rw = req.x[rows], req.ids[rows], req.w[rows]
    _send_kernel[(1,)](
        x,
        topk_ids,
        topk_weights,
        table,
        rx,
        rids,
        rw,
        req.flag,
        word,
        index,
        rows.start,
        x.numel(),
        n * k,
        K=k,
        SPAN=STEP_SPAN,
        ON_GPU=_on_gpu(req.flag),
        BLOCK=1024,
        num_warps=4,
    )


def take(
    ans: AnswerViews, rows: slice, errors: torch.Tensor, dtype: torch.dtype, add: torch.Tensor | None = None
):
    """The answer of ``ans``'s ``rows`` as a new ``[n, H]`` tensor of ``dtype`` in our memory
    (plus ``add`` where given, the in-process share), its status bits OR-ed into ``errors``;
    after :func:`wait`. Capturable."""
    src = ans.out[rows]
    dst = torch.empty(src.shape, dtype=dtype, device=errors.device)
    block = 1024
    _take_kernel[(triton.cdiv(src.numel(), block),)](
        src,
        ans.status,
        errors,
        dst,
        add if add is not None else dst,
        src.numel(),
        ADD=add is not None,
        BLOCK=block,
        num_warps=4,
    )
    return dst


def warm_up(device: torch.device) -> None:
    """Compiles and loads the kernels (both waits) on ``device`` (see the module's NOTE),
    synchronously."""
    with torch.cuda.device(device):
        step = torch.ones(1, dtype=torch.int64, device=device)
        flag, abort, errors = (torch.zeros(1, dtype=torch.int64, device=device) for _ in range(3))
        signal(flag, step, 0)
        wait(flag, step, 0, abort, errors, 1.0)
        wait(flag, step, 0, abort, errors, 1.0, at_least=True)
        torch.cuda.synchronize(device)
        assert int(errors) == 0, "the link's own flag was not seen"
