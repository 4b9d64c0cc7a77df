"""The CPU expert server's side of the host link: a decode step's MoE layers computed as the
coordinator publishes them in its shared-memory segment, by the backend's kernel thread
(kernels/moe_hostlink.c, kernels.KernelThread) with no Python per layer on either side.

Why: all-CPU int4 decode spent ~0.55-0.72 ms per MoE layer of which the kernel was 0.2-0.34 ms;
the rest was Python on both sides of the ring (descriptor, checks, views, wake-ups). The
protocol is the device link's (expertmesh/transport/link.py: request area, answer area, flags
``step * STEP_SPAN + i + 1``); here both areas are host memory the coordinator's GPU reads and
writes over PCIe, and the server's side is the C thread that starts every kernel of the backend
(one OpenMP team per process), spinning on each running link's request flag.

Per (bucket ``Tb``, placement generation) a *plan* is built once: per MoE layer the kernel that
:meth:`CpuExpertBackend.forward` would run for ``Tb`` rows (``kernel_for``) and its argument
block, pointing at the areas, our private routing buffers, the layer's packed weights and any
scratch. A step hands the plan to the thread (``hl_start``) and returns; the next step (or a
placement commit, or the close) first waits for it to end. The weights the plans point at are
kept here and never rewritten while a step runs: the worker's commit waits for this link's step
(ExpertWorker.commit), and steps of any other generation are refused.

Shapes: R rows of the areas, Tb bucket, H hidden, K top-k, I intermediate, S slots of a layer,
L MoE layers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from cpu_expert_server import kernels
from cpu_expert_server.kernels import amx_block, decode_block, packed_rows, qa_block
from expertmesh.errors import Incompatible, InvalidRequest, Unavailable
from expertmesh.transport import link_layout as ll

if TYPE_CHECKING:
    import ctypes

    from cpu_expert_server.packing import PackedFormat


class CpuKernels(Protocol):
    """What a host link needs of the CPU backend (cpu_expert_server/backend.py, which opens
    links: a Protocol here, not an import of it, keeps the two modules out of a cycle)."""

    lib: ctypes.CDLL | None
    fmt: PackedFormat | None
    threads: int
    caps: int
    qact: bool

    def kernel_for(self, x_dtype: torch.dtype, t: int, k: int, w13: torch.Tensor) -> tuple[str, int]: ...

    def _amx_int(self) -> bool: ...


MAX_TIMEOUT_MS = 600_000
KT_LINKS = 64  # moe_hostlink.c: the links one kernel thread serves
KERNELS = {"zero": 0, "qa": 1, "amx": 2, "decode": 3}  # moe_hostlink.c HL_ZERO ...
ROW, HEAD = 32, 3  # int64 words per layer of a plan, of which the head (kernel, S, counts)
Weights = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per MoE layer: packed w13, w2


class _Plan:
    """One bucket's plan ``[L, ROW]`` int64 and the scratch its argument blocks point at."""

    def __init__(self, rows: np.ndarray, scratch: tuple[torch.Tensor, ...]) -> None:
        self.rows, self.scratch = rows, scratch


class HostLink:
    """One fast-path channel's host link: its state on the kernel thread and its plans. :meth:`launch`,
    :meth:`collect` and :meth:`close` may come from two threads (the channel's, and a commit's
    wait); :meth:`cancel` from any thread."""

    host = True

    def __init__(
        self,
        backend: CpuKernels,
        request: torch.Tensor,  # uint8: the coordinator's request area (its segment)
        answer: torch.Tensor,  # uint8: the answer area we write (the same segment)
        rows: int,  # R
        hidden: int,
        top_k: int,
        dtype: torch.dtype,
    ) -> None:
        lib = backend.lib
        try:
            kt = kernels.kernel_thread(backend, lib, backend.threads) if lib is not None else None
        except OSError as e:  # the thread could not start
            raise Incompatible(f"the host link needs the CPU kernels' thread: {e}") from e
        if lib is None or kt is None:
            raise Incompatible("the CPU kernels are not built here: the host link needs their C poller")
        for what, area, need in (
            ("request", request, ll.request_bytes(rows, hidden, top_k, dtype)),
            ("answer", answer, ll.answer_bytes(rows, hidden, dtype)),
        ):
            if area.dtype != torch.uint8 or area.device.type != "cpu" or area.numel() < need:
                raise ValueError(
                    f"the {what} area holds {area.numel()} bytes, {rows} rows of H={hidden} K={top_k} "
                    f"{dtype} need {need} in host memory"
                )
            if area.data_ptr() % 64:
                raise ValueError(f"the {what} area is not 64-byte aligned")
        self.backend, self.lib = backend, lib
        self.rows, self.hidden, self.top_k, self.dtype = rows, hidden, top_k, dtype
        self.req = ll.RequestViews.of(request, rows, hidden, top_k, dtype)
        self.ans = ll.AnswerViews.of(answer, rows, hidden, dtype)
        # the thread's private copies of the routing: what it checks is what the kernel reads
        self._ids = torch.full((rows, top_k), -1, dtype=torch.int64)  # [R, K]
        self._w = torch.zeros(rows, top_k, dtype=torch.float32)  # [R, K]
        args = np.array(
            [
                request.data_ptr(),
                answer.data_ptr(),
                rows,
                hidden,
                top_k,
                dtype.itemsize,
                self._ids.data_ptr(),
                self._w.data_ptr(),
                kt.handle,
            ],
            dtype=np.int64,
        )
        self._kt = kt  # NOTE: the backend's kernel thread runs our steps: it outlives us
        self._h: int | None = lib.hl_open(args.ctypes.data)
        if not self._h:
            raise Incompatible(f"the kernel thread serves {KT_LINKS} host links already, its most")
        self._areas = (request, answer)  # NOTE: the thread reads and writes them until close
        self._lock = threading.RLock()  # launch / collect / close
        self._handle = threading.Lock()  # cancel against close (the handle is freed there)
        self.generation: int | None = None
        self.broken = ""
        self.last_step = -1
        self.logged: set[str] = set()  # what the worker has logged of this link (once each)
        self.fold_every = 16  # steps between token-count reports (as the device link)
        self.kernel_ns = self.wait_ns = 0  # of the last collected step (metrics, benchmarks)
        self.layers_answered = 0
        # a relayed link's areas (set by the worker's open_link) take micro-batched steps: the
        # relay hands their requests over one at a time into the first rows (relay.c); over
        # shared memory the coordinator's area holds them in other rows, which this does not read
        self.relayed = False
        self._launched = False
        self._plans: dict[tuple[int, int], _Plan] = {}  # (bucket, micro) ->
        self._keep: tuple = ()  # the generation's weights: the plans point into them
        self._slots: list[int] = []
        self._counts = np.zeros((0, 1), dtype=np.int64)  # [L, S' + 1], the thread adds
        self._folded = np.zeros((0, 1), dtype=np.int64)
        self._unfolded = 0
        self._report = np.zeros(5, dtype=np.int64)

    # ------------------------------------------------------------ per step

    def check(self, bucket: int, step: int, timeout_ms: int, micro: int = 1) -> None:
        """The refusals that depend on this link (typed errors; the worker checks the rest)."""
        if self.broken:
            raise Unavailable(self.broken)
        if micro > 1 and not self.relayed:
            raise InvalidRequest("micro-batched link steps run over a relayed link only")
        if self._h is None:
            raise Unavailable("the host link is closed")
        if not 0 < bucket <= self.rows:
            raise InvalidRequest(f"bucket {bucket} outside this link's rows (1..{self.rows})")
        if step <= self.last_step:
            raise InvalidRequest(
                f"link step {step} does not follow step {self.last_step}: steps must increase"
            )
        if not 0 < timeout_ms <= MAX_TIMEOUT_MS:
            raise InvalidRequest(f"link step timeout {timeout_ms} ms outside (0, {MAX_TIMEOUT_MS}]")

    def launch(
        self,
        generation: int,
        weights: Weights,
        bucket: int,
        step: int,
        rows: int,
        timeout_ms: int,
        micro: int = 1,
    ) -> ll.StepReport | None:
        """Hands step ``step`` of ``bucket`` rows (``rows`` of them real; the rest carry ids -1)
        for placement ``generation`` to the thread and returns the report of the step before
        (None: nothing new). The caller checked the generation against the live one.
        ``micro`` > 1 (a relayed link): ``micro`` requests of ``bucket`` rows per MoE layer,
        request ``i * micro + m`` computed as layer ``i`` (its plan row, repeated)."""
        with self._lock:
            self.check(bucket, step, timeout_ms, micro)
            assert 0 < rows <= bucket, f"{rows=} {bucket=}"
            report = self.collect()
            if generation != self.generation:
                if self._unfolded:  # the old generation's last counts, before its arrays go
                    report = ll.StepReport(
                        self.last_step, 0 if report is None else report.errors, self._fold()
                    )
                self._retire(generation, weights)
            plan = self._plans.get((bucket, micro))
            if plan is None:
                plan = self._plan(bucket)
                if micro > 1:  # NOTE: a copy, contiguous: the thread walks the rows in order
                    plan = _Plan(np.ascontiguousarray(np.repeat(plan.rows, micro, axis=0)), plan.scratch)
                self._plans[(bucket, micro)] = plan
            assert self._h is not None
            rc = self.lib.hl_start(
                self._h, plan.rows.ctypes.data, len(plan.rows), bucket, step, timeout_ms * 1_000_000
            )
            assert rc == 0, "the host link's thread still runs a step after collect()"
            self._launched, self.last_step = True, step
            return report

    def cancel(self) -> None:
        """Ends the last launched step's waits at once (any thread): its coordinator is gone."""
        with self._handle:
            if self._h is not None and self.last_step >= 0:
                self.lib.hl_cancel(self._h, self.last_step)

    def collect(self, fold: bool = False) -> ll.StepReport | None:
        """Waits for the last launched step to end (bounded: its waits time out) and returns its
        report, once (None: none since the last report), with the token counts since the last
        fold every :attr:`fold_every` steps or when ``fold``."""
        with self._lock:
            if not self._launched or self._h is None:
                return None
            # NOTE: in slices: the wait holds no GIL (ctypes) but a slice bounds each call
            while not self.lib.hl_wait(self._h, 1000, self._report.ctypes.data):
                pass
            self._launched = False
            self._unfolded += 1
            step, errors, self.layers_answered, self.kernel_ns, self.wait_ns = (int(v) for v in self._report)
            counts = self._fold() if fold or self._unfolded >= self.fold_every else []
            return ll.StepReport(step, errors, counts)

    def close(self) -> ll.StepReport | None:
        """Ends the step in flight (cancelled), joins the thread; the last report, with every
        count not reported yet. The areas are not touched afterwards."""
        self.cancel()  # NOTE: first: a collect holding the lock may be waiting for that step
        with self._lock:
            self.cancel()  # a step launched meanwhile (launch held the lock)
            report = self.collect(fold=True)
            if report is None and self._unfolded:
                report = ll.StepReport(self.last_step, 0, self._fold())
            with self._handle:
                h, self._h = self._h, None
                if h is not None:
                    self.lib.hl_close(h)
            self._plans.clear()
            self._keep = ()
            return report

    # ------------------------------------------------------------ plans

    def _fold(self) -> list[np.ndarray]:
        snap = self._counts.copy()  # [L, S' + 1]
        delta, self._folded = snap - self._folded, snap
        self._unfolded = 0
        return [delta[i, 1 : s + 1] for i, s in enumerate(self._slots)]

    def _retire(self, generation: int, weights: Weights) -> None:
        """A new placement generation: the old plans go (the thread is idle)."""
        self._plans.clear()
        self.generation = generation
        self._keep = tuple(weights)
        self._slots = [w13.shape[0] for w13, _ in weights]
        shape = (len(self._slots), max(self._slots, default=0) + 1)
        self._counts = np.zeros(shape, dtype=np.int64)
        self._folded = np.zeros(shape, dtype=np.int64)
        self._unfolded = 0

    def _plan(self, tb: int) -> _Plan:
        """Every layer's kernel and argument block for ``tb`` rows (backend.forward's choice)."""
        be, fmt = self.backend, self.backend.fmt
        rows = np.zeros((len(self._keep), ROW), dtype=np.int64)
        k, h, dt = self.top_k, self.hidden, self.dtype
        x, ids, w, out = (
            self.req.x.data_ptr(),
            self._ids.data_ptr(),
            self._w.data_ptr(),
            self.ans.out.data_ptr(),
        )
        bf = int(dt == torch.bfloat16)
        scratch: tuple[torch.Tensor, ...] = ()
        for i, (w13, w2) in enumerate(self._keep):
            kind, wcode = be.kernel_for(dt, tb, k, w13)
            if not kind:
                raise Incompatible(
                    f"a bucket of {tb} rows runs no C kernel on this server (torch GEMMs, or a choice "
                    "that depends on the routing): the host link takes decode-sized buckets"
                )
            s = w13.shape[0]
            rows[i, :HEAD] = (KERNELS[kind], s, self._counts[i].ctypes.data)
            if kind == "zero":
                continue
            assert fmt is not None and fmt.hidden == h, f"{fmt=} {h=}"
            wp = packed_rows(w13, w2)
            if kind == "qa":  # backend._qa's block, ids int64 (our private copy)
                block = qa_block(fmt, x, bf, ids, 0, w, tb, k, s, wp, out, bf, be.threads, be.caps)
            elif kind == "amx":  # backend._amx_into's block
                block = amx_block(
                    fmt, x, bf, ids, 0, w, tb, k, s, wp, wcode, out, bf, be.threads, int(be._amx_int())
                )
            else:  # backend._decode's block, with its scratch
                if not scratch:
                    scratch = (
                        torch.empty(tb * k, fmt.inter),  # act [Tb*K, I]
                        torch.empty(tb, h),  # out32 [Tb, H]
                        torch.empty(tb, h),  # x32 [Tb, H]
                    )
                act, o32, x32 = (t.data_ptr() for t in scratch)
                block = decode_block(fmt, x, bf, ids, w, tb, k, s, wp, wcode, (act, o32, x32), out, bf, be.threads, be.caps, int(be.qact))  # fmt: skip
            assert HEAD + len(block) <= ROW, f"{kind=} {len(block)=}"
            rows[i, HEAD : HEAD + len(block)] = block
        return _Plan(rows, scratch)
