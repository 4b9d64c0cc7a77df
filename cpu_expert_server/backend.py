"""The CPU expert backend: packed (optionally int8/int4) experts, a C GEMV kernel for decode,
an AMX kernel or torch GEMMs for prefill.

Shapes: T tokens, K top-k, S local slots, H hidden, I intermediate.

Decode is bandwidth-bound: one C call per layer streams each active expert's rows once
(kernels/moe_gemv.c), so the bytes read per token shrink with int8/int4. The C path serves every
call whose experts average at most ``gemv_max_tokens`` tokens each (T=64 over 128 experts is 4).
With int8/int4 weights (groups a multiple of 64) it quantises the activations to int8 per token
and group and takes integer dot products (VNNI or AVX2), unless ``qact=False``: that adds the
activations' rounding error (~1e-2 relative per layer output, tests/test_cpu_backend.py) and
keeps the weights bytes in the inner loop, where converting them to fp32 made the kernel
compute-bound. Prefill is compute-bound: on CPUs with AMX, bf16 calls go to one C call per layer
(kernels/moe_amx.c) that runs every active expert's GEMMs on bf16 tiles; elsewhere, per active
expert the rows are dequantised and multiplied with torch's GEMM (oneDNN in bf16 where the CPU has
bf16 instructions, fp32 MKL elsewhere, because torch's bf16 GEMM without them is several times
slower than converting first). Without AMX, int8/int4 on AVX2 integer dots stay in the decode kernel
up to GEMV_INT_MAX_TOKENS tokens per expert (prefill sizes included): there the per-call
dequantisation and fp32 GEMMs took 1.6-3x as long as the integer dots.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cpu_expert_server import kernels
from cpu_expert_server.packing import (
    DEFAULT_GROUP,
    PER_ROW,
    QUANT_DTYPES,
    WEIGHT_DTYPES,
    PackedFormat,
    Scratch,
    dequantize_rows,
    pack,
    quantize_rows,
    split_gate_up,
)
from expertmesh.experts import ExpertBackend
from expertmesh.lora.moe import LoRABatch, MoELoRAWeights, moe_lora_reference

if TYPE_CHECKING:
    from expertmesh.worker.slots import ReadExpert

log = logging.getLogger("expertmesh.cpu_backend")

# mean tokens per active expert above which a blocked GEMM beats the kernel's per-row dots
# (bench_cpu_experts.py measures both)
GEMV_MAX_TOKENS = 16
KERNEL_DTYPE_CODE = {torch.bfloat16: 0, torch.float32: 3}
# mean tokens per expert above which int8/int4 take the AMX path rather than the decode kernel's
# integer dots over tiled blocks (lent host: the kernel won up to 4 (Qwen3 T=64: int8
# 7.3 vs 7.6 ms, int4 8.1 vs 8.9), AMX from 6 (DeepSeek-V2-Lite T=64: 6.8 vs 8.1, 8.3 vs 11.4))
AMX_INT_MIN_TOKENS = 4
# mean tokens per expert up to which int8/int4 weights with integer dots stay in the decode kernel
# on CPUs without AMX (2-core AVX2, interleaved: at 32 and 48 tokens per expert the
# kernel took 0.33-0.64 of the time of dequantising every active expert to fp32 for torch's GEMMs,
# at 64 int8 was within noise of them; one OpenMP call per layer instead of several per expert
# also keeps it steady next to busy neighbours)
GEMV_INT_MAX_TOKENS = 48
# the kernels' argument blocks (int64 words; the builders below give their order):
# moe_decode_qa: moe_decode_q's 20 arguments, then whether the slot ids are int32
_QARGS = struct.Struct("21q")
_QIDS = {torch.int64: 0, torch.int32: 1}
# moe_amx_a: moe_amx/_q's arguments, dtype flags, which kernel
_AARGS = struct.Struct("22q")
# moe_decode_a: moe_decode[_q]'s arguments, dtype flags, scratch
_DARGS = struct.Struct("25q")
# dequant_rows_a: dequant_rows's 9 arguments
_RARGS = struct.Struct("9q")
_DIRECT = {  # each block's kernel called in the caller's thread (a backend without a kernel thread)
    kernels.KT_QA: "moe_decode_qa",
    kernels.KT_AMX: "moe_amx_a",
    kernels.KT_DECODE: "moe_decode_a",
    kernels.KT_DEQUANT: "dequant_rows_a",
}
_QX_DTYPES = (torch.bfloat16, torch.float32)


def cpu_has_bf16_matmul() -> bool:
    """True when the CPU has bf16 dot-product instructions (oneDNN then beats fp32 GEMM)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


class CpuExpertBackend(ExpertBackend):
    """Experts packed at load by :meth:`pack_weights`; ``forward`` takes only packed weights."""

    name = "cpu"

    def __init__(
        self,
        threads: int | None = None,
        weight_dtype: str = "bfloat16",
        group: int | None = None,
        gemv_max_tokens: int | None = None,
        use_kernel: bool = True,
        caps: int | None = None,
        qact: bool = True,
        kernel_thread: bool = True,
    ) -> None:
        """``caps``: the kernels' CPU capability bits (default: this CPU's, kernels.cpu_caps);
        ``kernel_thread``: every kernel starts from one thread of this backend's
        (kernels.KernelThread), whichever thread calls; False: from the caller's (a NUMA group's
        pinned thread, already the only one that calls its backend);
        ``qact``: int8/int4 decode may quantise activations (integer dot products);
        ``gemv_max_tokens``: mean tokens per expert the decode kernel takes (None: by format and
        CPU, :meth:`gemv_limit`; a number forces it, as benches and tests do)."""
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        self.threads = threads or torch.get_num_threads()
        self.weight_dtype, self.group, self.gemv_max_tokens = weight_dtype, group, gemv_max_tokens
        self.lib = kernels.load() if use_kernel else None
        self.caps = kernels.cpu_caps() if caps is None else caps
        self.qact = qact
        self.kernel_thread = kernel_thread
        amx_bit = kernels.CAPS["amx"][0]
        if self.lib is not None and self.caps & amx_bit and self.lib.moe_amx_init() != 0:
            log.warning("the CPU has AMX but the kernel refused it (arch_prctl): prefill uses torch GEMMs")
            self.caps &= ~amx_bit
        self.amx = self.lib is not None and bool(self.caps & amx_bit)
        self.gemm_dtype = torch.bfloat16 if cpu_has_bf16_matmul() else torch.float32
        self.fmt: PackedFormat | None = None  # fixed by the first pack: one model per server
        self._qkey: tuple | None = None  # the state _qdec_limit was computed for
        self._qlim = -1.0

    def pack_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, 2I, H], [S, H, I] -> packed [S, 2I, row13], [S, H, row2] (see packing.py)."""
        fmt = PackedFormat.for_shape(self.weight_dtype, w13.shape[2], w2.shape[2], self.group)
        if self.fmt is not None and fmt != self.fmt:
            raise ValueError(f"packed format changed from {self.fmt} to {fmt}")
        self.fmt = fmt
        return pack(w13.contiguous(), w2.contiguous(), fmt)

    def slot_views(
        self, w13: torch.Tensor, w2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The slot table's hook: where one slot's gate, up [I, H] and down [H, I] go in its
        packed rows ``w13 [2I, row13]``, ``w2 [H, row2]``, so the checkpoint is read straight
        into them; unquantised rows only (gate as [I/RB, RB, H] blocks of the interleaving),
        None for int8/int4 (quantised from the plain weights by pack_weights)."""
        fmt = self.fmt
        if fmt is None or fmt.quantised:
            return None
        return _interleaved(fmt, w13, w2)

    def read_packed(
        self, read: ReadExpert, w13: torch.Tensor, w2: torch.Tensor, scratch: Scratch, dtype: torch.dtype
    ) -> bool:
        """The slot table's hook for quantised rows: ``read`` puts one expert's gate, up
        [I, H] and down [H, I] into ``scratch`` buffers in ``dtype`` (this reader thread's own,
        reused expert after expert, already in the interleaved order), quantised straight into
        the slot's ``w13 [2I, row13]``, ``w2 [H, row2]``: the same bytes as pack_weights,
        without its fresh plain, interleaved and packed copies of every expert (each a few MB
        of new pages to fault in). False (nothing read) for unquantised rows (slot_views)."""
        fmt = self.fmt
        if fmt is None or not fmt.quantised:
            return False
        p13 = scratch("plain.w13", (2 * fmt.inter, fmt.hidden), dtype)  # [2I, H]
        p2 = scratch("plain.w2", (fmt.hidden, fmt.inter), dtype)  # [H, I]
        read(*_interleaved(fmt, p13, p2))
        quantize_rows(p13, fmt.wdtype, fmt.g13, w13, scratch)
        quantize_rows(p2, fmt.wdtype, fmt.g2, w2, scratch)
        return True

    def forward(self, x, w13, w2, slot_ids, weights, lora=None):
        if lora is None and self._qdec_limit() >= 0:
            out = self._decode_q_fast(x, w13, w2, slot_ids, weights)
            if out is not None:
                return out
        t, h = x.shape
        if t == 0 or w13.shape[0] == 0 or self.fmt is None:
            return torch.zeros_like(x)
        if lora is not None:
            return self._with_lora(x, w13, w2, slot_ids, weights, lora)
        fmt = self.fmt
        assert h == fmt.hidden, f"{h=} {fmt=}"
        wcode, pairs, per_expert = self._call_shape(w13, slot_ids)
        if self.lib is not None and wcode is not None and self._use_amx(x, wcode, pairs, per_expert):
            return self._amx(x, w13, w2, slot_ids, weights, wcode)
        limit = self.gemv_limit()
        if limit > GEMV_MAX_TOKENS and per_expert > GEMV_MAX_TOKENS:
            # prefill sizes on the int limit: count only this server's pairs (a NUMA group's
            # slice has the other groups' as -1), so the plain and the split backends agree
            here = int((slot_ids >= 0).sum())
            per_expert = here / max(1, min(w13.shape[0], here))
        if self.lib is not None and wcode is not None and per_expert <= limit:
            return self._decode(x, w13, w2, slot_ids, weights, wcode)
        return self._by_expert(x, w13, w2, slot_ids, weights)

    host_link = True  # open_link serves the host link (cpu_expert_server/hostlink.py)

    def kernel_for(self, x_dtype: torch.dtype, t: int, k: int, w13: torch.Tensor) -> tuple[str, int]:
        """Which C kernel :meth:`forward` runs for a call of ``t`` rows in ``x_dtype``, top-k
        ``k``, over the packed ``w13 [S, 2I, row13]``, with ids of any values and no LoRA (the host link's plans are
        built by it once per bucket): ("qa" moe_decode_qa | "amx" moe_amx_a | "decode"
        moe_decode[_q] | "zero" nothing to compute | "" no C kernel or a choice that depends on
        the ids, the weight code)."""
        fmt = self.fmt
        s = w13.shape[0]
        if fmt is None or self.lib is None or x_dtype not in _QX_DTYPES:
            return "", -1
        if s == 0 or t == 0:
            return "zero", -1
        pairs = t * k
        per_expert = pairs / max(1, min(s, pairs))
        if self._qdec_limit() >= 0 and per_expert <= self._qlim:
            return "qa", kernels.WDTYPE_CODE[fmt.wdtype]
        wcode = kernels.WDTYPE_CODE[fmt.wdtype] if fmt.quantised else KERNEL_DTYPE_CODE.get(w13.dtype)
        if wcode is None:
            return "", -1
        if self._use_amx(torch.empty(0, dtype=x_dtype), wcode, pairs, per_expert):
            return "amx", wcode
        limit = self.gemv_limit()
        if limit > GEMV_MAX_TOKENS and per_expert > GEMV_MAX_TOKENS:  # forward recounts the pairs here
            return "", -1
        return ("decode", wcode) if per_expert <= limit else ("", -1)

    def open_link(self, request, rows: int, hidden: int, top_k: int, dtype: torch.dtype, answer=None):
        """The host link over the coordinator's ``request`` area and the ``answer`` area, both in
        its shared-memory segment (cpu_expert_server/hostlink.py)."""
        from cpu_expert_server.hostlink import HostLink  # NOTE: only where a link is offered

        if answer is None:
            raise ValueError("a CPU server's link needs the answer area in the coordinator's segment")
        return HostLink(self, request, answer, rows, hidden, top_k, dtype)

    def _qdec_limit(self) -> float:
        """Mean tokens per expert up to which :meth:`forward` sends a call straight to the
        integer-dot decode kernel (-1: never, the format or CPU has no integer dots): the limit
        the general dispatch below applies to such calls, computed once per backend state
        (benchmarks and tests change these attributes on the object)."""
        key = (self.fmt, self.lib, self.amx, self.qact, self.caps, self.gemv_max_tokens)
        if key != self._qkey:
            self._qkey, self._qlim = key, self._qdec_limit_now()
        return self._qlim

    def _qdec_limit_now(self) -> float:
        fmt = self.fmt
        if self.lib is None or fmt is None or not fmt.quantised or not self._amx_int():
            return -1.0
        code = kernels.WDTYPE_CODE[fmt.wdtype]
        kind = kernels.DOT_KINDS[
            self.lib.moe_dot_kind(self.caps, code, fmt.hidden, fmt.inter, fmt.g13, fmt.g2, 1)
        ]
        if not kind.startswith("int8-dot"):
            return -1.0
        limit = self.gemv_limit()
        if self.amx and fmt.rb == 16 and fmt.hidden % 64 == 0 and fmt.inter % 64 == 0:
            return min(AMX_INT_MIN_TOKENS, limit)  # _use_amx takes what is above
        return min(limit, GEMV_MAX_TOKENS)  # above: forward's recount of local pairs first

    def forward_into(self, x, w13, w2, slot_ids, weights, out: torch.Tensor, loaded: object = None) -> bool:
        """The fast paths' call (ExpertWorker._compute_locked): the MoE of ``x [T, H]`` written
        straight into ``out [T, H]`` (the answer ring, bf16 or fp32) with the routing as the
        wire brings it (host ``slot_ids [T, K]`` int32 or int64, ``weights [T, K]`` float32),
        for the calls :meth:`forward` sends to the integer-dot decode kernel or to AMX: the
        conversions happen in C, no output is allocated, nothing is copied into the ring.
        The server's call (int32 ids) used to miss :meth:`_decode_q_fast`, and every call
        paid torch conversions, ctypes arguments, an output tensor and a copy into the ring;
        after the benchmark's cache flush each costs microseconds. False (nothing written): any
        other call (and bf16 x into an fp32 ``out``, which forward rounds to bf16 first); the
        caller then uses :meth:`forward`, so both paths answer the same bits. ``loaded``: the
        GPU graphs' argument (gpu_server/graphs.py), unused."""
        if (
            self.lib is None
            or self.fmt is None
            or slot_ids.dtype not in _QIDS
            or weights.dtype != torch.float32
            or x.dtype not in _QX_DTYPES
            or out.dtype not in _QX_DTYPES
            or (x.dtype, out.dtype) == (torch.bfloat16, torch.float32)  # forward rounds to bf16 first
            or out.is_cuda
            or out.shape != x.shape
            or weights.shape != slot_ids.shape
            or not (
                x.is_contiguous()
                and out.is_contiguous()
                and slot_ids.is_contiguous()
                and weights.is_contiguous()
            )
        ):
            return False
        t, k = slot_ids.shape
        if t == 0 or w13.shape[0] == 0 or x.shape != (t, self.fmt.hidden):
            return False
        if self._qdec_limit() >= 0 and self._q_sized(x, w13, t, k):
            self._qa(x, w13, w2, slot_ids, weights, out)
            return True
        return self._amx_into(x, w13, w2, slot_ids, weights, out)

    def _amx_into(self, x, w13, w2, slot_ids, weights, out: torch.Tensor) -> bool:
        """forward_into for the calls :meth:`forward` sends to :meth:`_amx` (one moe_amx_a call,
        the same kernels and roundings); False for the others."""
        fmt, lib = self.fmt, self.lib
        assert fmt is not None and lib is not None
        wcode, pairs, per_expert = self._call_shape(w13, slot_ids)
        if wcode is None or not self._use_amx(x, wcode, pairs, per_expert):
            return False
        t, k = slot_ids.shape
        block = kernels.amx_block(
            fmt, x.data_ptr(), int(x.dtype == torch.bfloat16), slot_ids.data_ptr(), _QIDS[slot_ids.dtype],
            weights.data_ptr(), t, k, w13.shape[0], kernels.packed_rows(w13, w2), wcode, out.data_ptr(),
            int(out.dtype == torch.bfloat16), self.threads, int(self._amx_int()),
        )  # fmt: skip
        rc = self._run(kernels.KT_AMX, _AARGS.pack(*block))
        if rc == -1:
            raise ValueError(f"slot ids outside [-1, {w13.shape[0]})")
        assert rc == 0, f"moe_amx rejected {fmt}: {rc=}"
        return True

    def _call_shape(self, w13, slot_ids) -> tuple[int | None, int, float]:
        """The kernels' weight code (None: none takes these weights), the (token, expert) pairs
        and a lower bound on the mean pairs per active expert: what the dispatch decides by."""
        fmt = self.fmt
        assert fmt is not None
        wcode = kernels.WDTYPE_CODE[fmt.wdtype] if fmt.quantised else KERNEL_DTYPE_CODE.get(w13.dtype)
        pairs = slot_ids.numel()
        return wcode, pairs, pairs / max(1, min(w13.shape[0], pairs))

    def _q_sized(self, x, w13, t: int, k: int) -> bool:
        """A decode-sized call of x [t, H] the integer-dot kernel takes (the dispatch's limit)."""
        fmt = self.fmt
        assert fmt is not None
        s, pairs = w13.shape[0], t * k
        return s > 0 and x.shape == (t, fmt.hidden) and pairs / max(1, min(s, pairs)) <= self._qlim

    def _qa(self, x, w13, w2, slot_ids, weights, out: torch.Tensor) -> None:
        """One moe_decode_qa call: contiguous int32/int64 ids and float32 weights [T, K], x and
        out contiguous bf16/fp32 [T, H] (the callers checked)."""
        fmt, lib = self.fmt, self.lib
        assert fmt is not None and lib is not None
        t, k = slot_ids.shape
        s = w13.shape[0]
        block = kernels.qa_block(
            fmt, x.data_ptr(), int(x.dtype == torch.bfloat16), slot_ids.data_ptr(), _QIDS[slot_ids.dtype],
            weights.data_ptr(), t, k, s, kernels.packed_rows(w13, w2), out.data_ptr(), int(out.dtype == torch.bfloat16),
            self.threads, self.caps,
        )  # fmt: skip
        rc = self._run(kernels.KT_QA, _QARGS.pack(*block))
        if rc == -1:
            raise ValueError(f"slot ids outside [-1, {s})")
        assert rc == 0, f"moe_decode_qa: {rc=} for {fmt}"  # -2 (no integer dots) is ruled out by _qlim

    def _decode_q_fast(self, x, w13, w2, slot_ids, weights) -> torch.Tensor | None:
        """The decode-sized int8/int4 call with as few Python and torch operations as there can
        be (under the benchmark's cache flush each costs microseconds; the glue was
        ~50 us of a 0.38 ms int4 layer): arguments packed into one int64 block for moe_decode_qa.
        None when the call is not one (the general dispatch then decides, as it always did)."""
        if (
            x.dtype not in _QX_DTYPES
            or slot_ids.dtype not in _QIDS
            or weights.dtype != torch.float32
            or not (x.is_contiguous() and slot_ids.is_contiguous() and weights.is_contiguous())
        ):
            return None
        t, k = slot_ids.shape
        if t == 0 or not self._q_sized(x, w13, t, k):
            return None
        out = torch.empty_like(x)  # [T, H]
        self._qa(x, w13, w2, slot_ids, weights, out)
        return out

    def _amx_int(self) -> bool:
        """int8/int4 on AMX int8 tiles (activations quantised, as the decode kernel's int path)."""
        fmt = self.fmt
        return fmt is not None and fmt.quantised and self.qact and fmt.g13 % 64 == 0 and fmt.g2 % 64 == 0

    def _use_amx(self, x: torch.Tensor, wcode: int, pairs: int, per_expert: float) -> bool:
        fmt = self.fmt
        if not self.amx or fmt is None or fmt.rb != 16 or fmt.hidden % 64 or fmt.inter % 64:
            return False
        # bf16: tile loads stream the rows faster than the decode kernel even at T=1
        # (bench_cpu_experts "/amx" vs "/kernel"), so AMX takes every call it covers. int8/int4
        # with activation quantisation (the same numerics either way): the decode kernel's
        # integer dots over tiled blocks up to AMX_INT_MIN_TOKENS tokens per expert, AMX above
        if wcode == 0 and x.dtype == torch.bfloat16:
            return True
        if self._amx_int():
            return per_expert > min(AMX_INT_MIN_TOKENS, self.gemv_limit())
        # quantised weights dequantised to bf16 tiles: prefill only (a bf16 server)
        return fmt.quantised and x.dtype == torch.bfloat16 and per_expert > self.gemv_limit()

    def gemv_limit(self) -> int:
        """Mean tokens per expert up to which calls go to the decode kernel: the forced value,
        else GEMV_INT_MAX_TOKENS for int8/int4 on AVX2 integer dots without AMX (dequantising every
        active expert for torch's GEMMs costs more there than the integer dots save),
        else GEMV_MAX_TOKENS. AMX hosts keep GEMV_MAX_TOKENS: their dispatch is unchanged."""
        if self.gemv_max_tokens is not None:
            return self.gemv_max_tokens
        fmt = self.fmt
        if self.amx or self.lib is None or fmt is None or not fmt.quantised or not self.qact:
            return GEMV_MAX_TOKENS
        code = kernels.WDTYPE_CODE[fmt.wdtype]
        kind = self.lib.moe_dot_kind(self.caps, code, fmt.hidden, fmt.inter, fmt.g13, fmt.g2, 1)
        # NOTE: AVX2 integer dots only: measured against fp32 GEMMs on an AVX2 machine; VNNI
        # hosts without AMX (and their bf16 GEMMs, where they have them) are unmeasured
        return GEMV_INT_MAX_TOKENS if kernels.DOT_KINDS[kind] == "int8-dot avx2" else GEMV_MAX_TOKENS

    def dot_kind(self) -> str:
        """Which dot products the decode kernel uses for the packed format (for logs and benches)."""
        if self.lib is None or self.fmt is None:
            return "torch"
        fmt = self.fmt
        code = kernels.WDTYPE_CODE[fmt.wdtype]
        k = self.lib.moe_dot_kind(self.caps, code, fmt.hidden, fmt.inter, fmt.g13, fmt.g2, int(self.qact))
        return kernels.DOT_KINDS[k]

    def _run(self, kind: int, block: bytes) -> int:
        """Kernel ``kind`` (kernels.KT_QA ...) on its argument block: on this backend's kernel
        thread (one OpenMP team per process, whichever thread calls), else in this thread (also
        with one thread: no team to share, and the hand-over would only cost)."""
        assert self.lib is not None
        kt = (
            kernels.kernel_thread(self, self.lib, self.threads)
            if self.kernel_thread and self.threads > 1
            else None
        )
        if kt is not None:
            return kt.call(kind, block)
        return getattr(self.lib, _DIRECT[kind])(block)

    def _decode(self, x, w13, w2, slot_ids, weights, wcode: int) -> torch.Tensor:
        """One moe_decode_a call: the integer-dot kernel for int8/int4 with activation
        quantisation (bf16/fp32 in and out, its own scratch), else the general kernel on fp32
        activations (bf16 widened and the answer rounded in C, as torch does)."""
        fmt = self.fmt
        assert fmt is not None and self.lib is not None
        t, k = slot_ids.shape
        # (.to() costs ~1.5 us even when the dtype is already right)
        xc = x.contiguous() if x.dtype in _QX_DTYPES else x.to(torch.float32).contiguous()  # [T, H]
        sid = slot_ids if slot_ids.dtype == torch.int64 else slot_ids.to(torch.int64)
        wts = weights if weights.dtype == torch.float32 else weights.to(torch.float32)
        sid, wts = sid.contiguous(), wts.contiguous()  # [T, K] each
        out = torch.empty_like(xc)  # [T, H]
        bf = int(xc.dtype == torch.bfloat16)
        act = torch.empty(t * k, fmt.inter)  # [T*K, I] scratch
        o32, x32 = (torch.empty(t, fmt.hidden), torch.empty(t, fmt.hidden)) if bf else (out, xc)  # [T, H]
        block = kernels.decode_block(
            fmt, xc.data_ptr(), bf, sid.data_ptr(), wts.data_ptr(), t, k, w13.shape[0], kernels.packed_rows(w13, w2),
            wcode, (act.data_ptr(), o32.data_ptr(), x32.data_ptr()), out.data_ptr(), bf, self.threads,
            self.caps, int(self.qact),
        )  # fmt: skip
        if self._run(kernels.KT_DECODE, _DARGS.pack(*block)) != 0:
            raise ValueError(f"slot ids outside [-1, {w13.shape[0]})")
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _amx(self, x, w13, w2, slot_ids, weights, wcode: int) -> torch.Tensor:
        """AMX tiles (bf16, or int8 for quantised weights): every active expert's GEMMs in one C call."""
        fmt = self.fmt
        assert fmt is not None and self.lib is not None
        t, k = slot_ids.shape
        x32 = x.to(torch.float32).contiguous()  # [T, H]
        sid = slot_ids.to(torch.int64).contiguous()  # [T, K]
        wts = weights.to(torch.float32).contiguous()  # [T, K]
        out = torch.empty(t, fmt.hidden)  # [T, H] fp32
        block = kernels.amx_block(
            fmt, x32.data_ptr(), 0, sid.data_ptr(), 0, wts.data_ptr(), t, k, w13.shape[0], kernels.packed_rows(w13, w2),
            wcode, out.data_ptr(), 0, self.threads, int(self._amx_int()),
        )  # fmt: skip
        rc = self._run(kernels.KT_AMX, _AARGS.pack(*block))
        if rc == -1:
            raise ValueError(f"slot ids outside [-1, {w13.shape[0]})")
        assert rc == 0, f"moe_amx rejected {fmt}: {rc=}"
        return out.to(x.dtype)

    def _dense(self, rows: torch.Tensor, c: int, g: int, cd: torch.dtype) -> torch.Tensor:
        """One expert's packed rows [R, row] -> [R, C] in the GEMM dtype ``cd``."""
        fmt = self.fmt
        assert fmt is not None
        if not fmt.quantised:
            return rows.to(cd)
        if self.lib is None:
            return dequantize_rows(rows, fmt.wdtype, c, g).to(cd)
        out = torch.empty(rows.shape[0], c)
        code = kernels.WDTYPE_CODE[fmt.wdtype]
        block = (
            rows.data_ptr(),
            rows.stride(0),
            rows.shape[0],
            c,
            code,
            g,
            out.data_ptr(),
            self.threads,
            self.caps,
        )
        self._run(kernels.KT_DEQUANT, _RARGS.pack(*block))
        return out.to(cd)

    def _by_expert(self, x, w13, w2, slot_ids, weights) -> torch.Tensor:
        """A GEMM pair per active expert (prefill; and decode where the kernel is unavailable)."""
        fmt = self.fmt
        assert fmt is not None
        if ((slot_ids < -1) | (slot_ids >= w13.shape[0])).any():
            raise ValueError(f"slot ids outside [-1, {w13.shape[0]})")
        # an fp32 server stays fp32 end to end; bf16/fp16 ones run the GEMM in the fast dtype
        cd = torch.float32 if x.dtype == torch.float32 else self.gemm_dtype
        # one sort for the whole call: (token, k) pairs grouped by slot, k-major like the reference
        flat = slot_ids.t().reshape(-1)  # [K*T]
        order = torch.argsort(flat, stable=True)  # [K*T]
        counts = torch.bincount(flat[order] + 1, minlength=w13.shape[0] + 1).tolist()  # slot -1 first
        tok = order % x.shape[0]  # [K*T]
        xs = x.to(cd)[tok]  # [K*T, H] rows grouped by slot
        ys = torch.empty(xs.shape[0], fmt.hidden, dtype=cd)  # [K*T, H]
        lo = counts[0]  # skip the pairs whose expert is elsewhere
        for s, n in enumerate(counts[1:]):
            if n == 0:
                continue
            gu = F.linear(
                xs[lo : lo + n], self._dense(w13[s], fmt.hidden, fmt.g13, cd)
            )  # [n, 2I] interleaved
            gate, up = split_gate_up(gu, fmt.rb)
            ys[lo : lo + n] = F.linear(F.silu(gate) * up, self._dense(w2[s], fmt.inter, fmt.g2, cd))
            lo += n
        w = weights.t().reshape(-1)[order[counts[0] :]].float()  # [pairs here]
        out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        out.index_add_(0, tok[counts[0] :], ys[counts[0] :].float() * w[:, None])
        return out.to(x.dtype)

    def _with_lora(self, x, w13, w2, slot_ids, weights, lora: LoRABatch) -> torch.Tensor:
        """MoE LoRA: the delta goes inside each expert (before the activation), which the packed
        kernels do not do, so the active slots are unpacked and the batched reference runs on
        them (and on the matching slices of the LoRA buffers)."""
        fmt = self.fmt
        assert fmt is not None
        if ((slot_ids < -1) | (slot_ids >= w13.shape[0])).any():
            raise ValueError(f"slot ids outside [-1, {w13.shape[0]})")
        active = torch.unique(slot_ids[slot_ids >= 0])  # [A] sorted local slots
        remap = torch.full((w13.shape[0],), -1, dtype=torch.long)
        remap[active] = torch.arange(active.numel())
        local = torch.where(slot_ids >= 0, remap[slot_ids.clamp_min(0).long()], -1)  # [T, K]
        dense13, dense2 = [], []
        for s in active.tolist():
            gate_up = self._dense(w13[s], fmt.hidden, fmt.g13, x.dtype)  # [2I, H] interleaved rows
            gate, up = split_gate_up(gate_up.t(), fmt.rb)  # [H, I] each
            dense13.append(torch.cat([gate, up], dim=1).t())  # [2I, H] gate rows, then up rows
            dense2.append(self._dense(w2[s], fmt.inter, fmt.g2, x.dtype))  # [H, I]
        if not dense13:
            return torch.zeros_like(x)
        lw = lora.weights
        sub = MoELoRAWeights(*(w[:, active] for w in (lw.a13, lw.b13, lw.a2, lw.b2)))  # [L, A, ...]
        return moe_lora_reference(
            x, torch.stack(dense13), torch.stack(dense2), local, weights, sub, lora.token_adapter
        )


def _interleaved(
    fmt: PackedFormat, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate and up [I/RB, RB, H] views of a [2I, H] buffer in packing.interleave's order, and
    down [H, I]."""
    blocks = w13.view(fmt.inter // fmt.rb, 2, fmt.rb, fmt.hidden)
    return blocks[:, 0], blocks[:, 1], w2


def group_text(weight_dtype: str, group: int | None) -> str:
    """How a log line names the quantisation group ("" for unquantised weights)."""
    if weight_dtype not in QUANT_DTYPES:
        return ""
    if group is None:
        return f" (groups of {DEFAULT_GROUP[weight_dtype]})"
    return " (one scale per row)" if group == PER_ROW else f" (groups of up to {group})"


def make_backend(
    threads: int | None = None, weight_dtype: str = "bfloat16", group: int | None = None
) -> ExpertBackend:
    """The CPU expert backend with ``threads`` compute threads (default: torch's); ``group``:
    the int8/int4 quantisation group (PackedFormat.for_shape)."""
    backend = CpuExpertBackend(threads, weight_dtype, group=group)
    log.info(
        "CPU experts: weights %s%s, %d threads, decode kernel %s (CPU caps %d), prefill %s",
        weight_dtype, group_text(weight_dtype, group), backend.threads, "C" if backend.lib is not None else "torch (fallback)", backend.caps,
        "AMX kernel (bf16 servers)" if backend.amx else f"torch GEMM in {backend.gemm_dtype}",
    )  # fmt: skip
    return backend
