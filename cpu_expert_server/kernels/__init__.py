"""The CPU MoE kernels in C (``moe_gemv.c``, which includes the other ``.c`` files here), built on
first use with the system C compiler.

The C needs no torch headers, so it builds in a few seconds with ``cc -O3 -fopenmp`` (a torch C++
extension takes minutes on a 2-core machine) and is called through ctypes with raw pointers. No
``-march``: each ISA-specific function carries its own target attribute and the caller picks one
at run time from :func:`cpu_caps`, so one build serves every x86-64 CPU. The library is cached per
source hash and compiler; without a compiler :func:`load` logs why and returns None, and the
backend falls back to torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from expertmesh.cbuild import build_cached

if TYPE_CHECKING:
    import torch

    from cpu_expert_server.packing import PackedFormat

log = logging.getLogger("expertmesh.cpu_kernels")

SOURCE = Path(__file__).with_name("moe_gemv.c")
FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-pthread", "-fPIC", "-shared", "-Wno-psabi"]
WDTYPE_CODE = {"bfloat16": 0, "int8": 1, "int4": 2}
# capability bits of the C side (moe_gemv.c CAP_*), each needing all of its /proc/cpuinfo flags
CAPS = {
    "avx2": (1, ("avx2", "fma")),
    "avx512": (2, ("avx512f", "avx512bw", "avx512vl")),
    "vnni": (4, ("avx512_vnni",)),
    "bf16": (8, ("avx512_bf16",)),
    "amx": (16, ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16")),
}
DOT_KINDS = ("fp32", "int8-dot avx2", "int8-dot avx512-vnni", "bf16-dot avx512")
# the kernels a KernelThread runs, by their argument blocks (moe_hostlink.c HL_QA ...)
KT_QA, KT_AMX, KT_DECODE, KT_DEQUANT = 1, 2, 3, 4
Packed = tuple[int, int, int, int]  # w13's address and row bytes, w2's


def packed_rows(w13: torch.Tensor, w2: torch.Tensor) -> Packed:
    """A layer's packed weights as the kernels take them: (w13, its row bytes, w2, its row bytes)."""
    return w13.data_ptr(), w13.stride(1) * w13.element_size(), w2.data_ptr(), w2.stride(1) * w2.element_size()


def qa_block(
    fmt: PackedFormat, x: int, xbf: int, ids: int, ids32: int, w: int, t: int, k: int, s: int, wp: Packed,
    out: int, obf: int, threads: int, caps: int,
) -> tuple[int, ...]:  # fmt: skip
    """moe_decode_qa's block: x [t, H] (bf16 when ``xbf``), ids [t, k] (int32 when ``ids32``),
    weights w [t, k] fp32, ``s`` slots, out [t, H] (bf16 when ``obf``); addresses as ints."""
    return (x, xbf, ids, w, t, k, s, *wp, fmt.hidden, fmt.inter, WDTYPE_CODE[fmt.wdtype], fmt.g13,
            fmt.g2, out, obf, threads, caps, ids32)  # fmt: skip


def amx_block(
    fmt: PackedFormat, x: int, xbf: int, ids: int, ids32: int, w: int, t: int, k: int, s: int, wp: Packed,
    wcode: int, out: int, obf: int, threads: int, amx_int: int,
) -> tuple[int, ...]:  # fmt: skip
    """moe_amx_a's block (qa_block's arguments; ``amx_int``: int8 tiles, moe_amx_q)."""
    return (x, xbf, ids, ids32, w, t, k, s, *wp, fmt.hidden, fmt.inter, fmt.rb, wcode, fmt.g13, fmt.g2, out,
            obf, threads, amx_int)  # fmt: skip


def decode_block(
    fmt: PackedFormat, x: int, xbf: int, ids: int, w: int, t: int, k: int, s: int, wp: Packed, wcode: int,
    scratch: tuple[int, int, int], out: int, obf: int, threads: int, caps: int, qact: int,
) -> tuple[int, ...]:  # fmt: skip
    """moe_decode_a's block (ids int64; ``scratch``: act [t*K, I], out32 [t, H] and x32 [t, H]
    fp32, the last two read only for bf16 out and in)."""
    act, o32, x32 = scratch
    return (x, xbf, ids, w, t, k, s, *wp, fmt.hidden, fmt.inter, fmt.rb, wcode, fmt.g13, fmt.g2, act, o32, out,
            obf, threads, caps, qact, x32)  # fmt: skip


# how long the idle kernel thread spins for its next call before it sleeps: a futex wake-up costs
# tens of microseconds (~100 on the 2-core VM, two per call there: a bf16 call of 0.15 ms took
# 0.39 ms through the thread without spinning, 0.16-0.20 with the caller spinning too, both
# yielding). Where cores are spare a caller sleeps at once: spinning beside the kernel's team
# took a core or a hyperthread's sibling from it (28 threads on a 32-CPU host: 0.98-1.53 ms a
# bf16 call against 0.67-0.71 ms called directly), and the thread's idle spin (200, 1000 or
# 3000 us) made no difference there
KT_SPIN_US = 200


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_caps(names: tuple[str, ...] | None = None) -> int:
    """The CAP_* bits this CPU has (``names``: only these, e.g. to test a narrower path)."""
    flags = cpu_flags()
    return sum(
        bit for name, (bit, need) in CAPS.items() if (names is None or name in names) and flags >= set(need)
    )


def build(defines: tuple[str, ...] = (), source: Path = SOURCE) -> Path:
    """Compiles moe_gemv.c (or reuses the cached build); raises OSError/CalledProcessError.

    ``defines``: extra ``-D`` macros for a variant build (tests and benchmarks only):
    EXPERTMESH_AMX_EMULATE runs the AMX tile logic as plain C on any x86-64 CPU, AMX_PROFILE adds
    ``moe_amx_profile`` (seconds per stage of the AMX kernel). ``source``: another copy of the
    kernels (a benchmark's baseline)."""
    flags = [*FLAGS, *(f"-D{d}" for d in defines)]
    # NOTE: moe_gemv.c includes the other .c files: they are in the key, not on the command line
    deps = sorted(source.parent.glob("*.c"))
    return build_cached("moe_gemv", "cpu_kernels", [source], flags, key_sources=deps, libs=["-lm"])


def load(defines: tuple[str, ...] = (), source: Path = SOURCE) -> ctypes.CDLL | None:
    """The kernel library, or None (with the reason logged) when it cannot be built here."""
    try:
        lib = ctypes.CDLL(str(build(defines, source)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (
            e.stderr.decode(errors="replace")[-500:] if isinstance(e, subprocess.CalledProcessError) else ""
        )
        log.warning("CPU MoE kernels unavailable, using the torch fallback: %s %s", e, detail)
        return None
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.moe_decode.argtypes = [p, p, p, i, i, i, p, L, p, L, i, i, i, i, i, i, p, p, i, i, i]
    lib.moe_decode.restype = i
    lib.moe_decode_q.argtypes = [p, i, p, p, i, i, i, p, L, p, L, i, i, i, i, i, p, i, i, i]
    lib.moe_decode_q.restype = i
    if hasattr(lib, "moe_decode_qa"):  # moe_decode_q's arguments as int64 [20]; not in older copies
        lib.moe_decode_qa.argtypes = [ctypes.c_char_p]
        lib.moe_decode_qa.restype = i
    lib.moe_qdot_profile.argtypes = [p]
    lib.moe_qdot_profile.restype = None
    lib.moe_amx.argtypes = [p, p, p, i, i, i, p, L, p, L, i, i, i, i, i, i, p, i]
    lib.moe_amx.restype = i
    lib.moe_amx_q.argtypes = [p, p, p, i, i, i, p, L, p, L, i, i, i, i, i, i, p, p, i]
    lib.moe_amx_q.restype = i
    if hasattr(lib, "moe_amx_a"):  # moe_amx/_q's arguments as int64 [22]
        lib.moe_amx_a.argtypes = [ctypes.c_char_p]
        lib.moe_amx_a.restype = i
    if hasattr(lib, "moe_amx_peak"):  # a baseline copy of the kernels may predate it
        lib.moe_amx_peak.argtypes = [i, i, L, i]
        lib.moe_amx_peak.restype = ctypes.c_double
    if "AMX_PROFILE" in defines:
        lib.moe_amx_profile.argtypes = [p]
        lib.moe_amx_profile.restype = None
    if hasattr(lib, "kt_open"):  # the kernel thread and its blocks (moe_hostlink.c); not in older copies
        q = ctypes.c_int64
        for name in ("moe_decode_a", "dequant_rows_a"):
            getattr(lib, name).argtypes = [ctypes.c_char_p]
            getattr(lib, name).restype = i
        lib.kt_open.argtypes = [q, i]
        lib.kt_open.restype = p
        lib.kt_call.argtypes = [p, i, ctypes.c_char_p]
        lib.kt_call.restype = i
        lib.kt_close.argtypes = [p]
        lib.kt_close.restype = i
    if hasattr(lib, "hl_open"):  # the host link's poller (moe_hostlink.c); not in older copies
        q = ctypes.c_int64
        lib.hl_open.argtypes = [p]
        lib.hl_open.restype = p
        lib.hl_start.argtypes = [p, p, i, i, q, q]
        lib.hl_start.restype = i
        lib.hl_cancel.argtypes = [p, q]
        lib.hl_cancel.restype = None
        lib.hl_wait.argtypes = [p, q, p]
        lib.hl_wait.restype = i
        lib.hl_close.argtypes = [p]
        lib.hl_close.restype = None
    lib.moe_amx_init.argtypes = []
    lib.moe_amx_init.restype = i
    lib.moe_dot_kind.argtypes = [i, i, i, i, i, i, i]
    lib.moe_dot_kind.restype = i
    lib.dequant_rows.argtypes = [p, L, i, i, i, i, p, i, i]
    lib.dequant_rows.restype = None
    return lib


class KernelThread:
    """The one thread that starts a backend's kernels (moe_hostlink.c's kernel thread): libgomp
    gives every thread that starts a parallel region a team of its own, and two teams whose
    threads outnumber the CPUs throttle each other's waits (a bf16 decode layer ~1.4x slower
    from a second thread, benchmarks/bench_omp_teams.py). :meth:`call` hands a kernel's argument
    block to it and waits (from any thread, one call at a time); host links run their steps on
    it (cpu_expert_server/hostlink.py). Closed when collected, once no link holds it."""

    def __init__(self, lib: ctypes.CDLL, spin_us: float, yield_cpu: bool = False) -> None:
        handle = lib.kt_open(int(spin_us * 1000), int(yield_cpu))
        if not handle:
            raise OSError("the CPU kernels' thread could not be started")
        self.lib, self.handle, self.pid = lib, handle, os.getpid()
        weakref.finalize(self, lib.kt_close, handle).atexit = False

    def call(self, kind: int, block: bytes) -> int:
        """Kernel ``kind`` (KT_QA ...) on the int64 argument ``block``, run on the thread; its code."""
        return self.lib.kt_call(self.handle, kind, block)


_kt_lock = threading.Lock()


def kernel_thread(owner: object, lib: ctypes.CDLL | None, threads: int) -> KernelThread | None:
    """``owner``'s KernelThread for ``lib`` (kept as its ``_kt`` attribute; a new one in a forked
    child, which has no thread, or for another ``lib``, as tests swap), started on first use;
    None where ``lib`` has none (an older copy of the kernels, a benchmark's baseline). Where no
    core is free beside the ``threads`` of the kernels' team, it and its callers spin yielding
    the CPU; elsewhere callers sleep at once (kt_open)."""
    kt = getattr(owner, "_kt", None)
    if kt is not None and kt.pid == os.getpid() and kt.lib is lib:
        return kt
    if lib is None or not hasattr(lib, "kt_open"):
        return None
    with _kt_lock:
        kt = getattr(owner, "_kt", None)
        if kt is None or kt.pid != os.getpid() or kt.lib is not lib:
            kt = KernelThread(lib, KT_SPIN_US, yield_cpu=(os.cpu_count() or 1) <= threads + 1)
            owner._kt = kt  # type: ignore[attr-defined]
        return kt
