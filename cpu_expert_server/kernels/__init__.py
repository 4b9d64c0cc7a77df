"""The CPU MoE kernels in C (``moe_gemv.c``), built on first use with the system C compiler.

The C file needs no torch headers, so it builds in about a second with ``cc -O3 -march=native
-fopenmp`` (a torch C++ extension takes minutes on a 2-core machine) and is called through ctypes
with raw pointers. The built library is cached per source hash, compiler and CPU; without a
compiler :func:`load` logs why and returns None, and the backend falls back to torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("expertmesh.cpu_kernels")

SOURCE = Path(__file__).with_name("moe_gemv.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-Wno-psabi"]
WDTYPE_CODE = {"bfloat16": 0, "int8": 1, "int4": 2}


def _cache_dir() -> Path:
    base = os.environ.get("EXPERTMESH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "expertmesh"
    )
    return Path(base) / "cpu_kernels"


def _cpu_tag() -> str:
    # NOTE: -march=native bakes the build host's ISA in; key the cache on the CPU model so a
    # shared home directory on a different CPU rebuilds instead of hitting illegal instructions
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def build() -> Path:
    """Compiles moe_gemv.c (or reuses the cached build); raises OSError/CalledProcessError."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc/gcc) on PATH")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + cc.encode() + " ".join(FLAGS).encode() + _cpu_tag().encode()).hexdigest()[:16]
    out = _cache_dir() / f"moe_gemv-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        subprocess.run([cc, *FLAGS, "-o", str(tmp_so), str(SOURCE), "-lm"], check=True, capture_output=True)
        os.replace(tmp_so, out)  # atomic: concurrent servers never load a half-written file
    return out


def load() -> ctypes.CDLL | None:
    """The kernel library, or None (with the reason logged) when it cannot be built here."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (
            e.stderr.decode(errors="replace")[-500:] if isinstance(e, subprocess.CalledProcessError) else ""
        )
        log.warning("CPU MoE kernels unavailable, using the torch fallback: %s %s", e, detail)
        return None
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.moe_decode.argtypes = [p, p, p, i, i, i, p, L, p, L, i, i, i, i, i, i, p, p, i]
    lib.moe_decode.restype = i
    lib.dequant_rows.argtypes = [p, L, i, i, i, i, p, i]
    lib.dequant_rows.restype = None
    return lib
