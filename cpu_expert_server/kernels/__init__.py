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
import subprocess
from pathlib import Path

from expertmesh.cbuild import build_cached

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
    "amx": (16, ("amx_tile", "amx_bf16", "amx_int8")),
}
DOT_KINDS = ("fp32", "int8-dot avx2", "int8-dot avx512-vnni", "bf16-dot avx512")


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
