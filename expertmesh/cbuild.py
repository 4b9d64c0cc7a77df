"""Shared libraries built from C sources on first use with the system C compiler, cached per
source, compiler, flags and machine (the CPU expert kernels, the TCP relay).

The C needs no Python or torch headers, so a build takes seconds; it is called through ctypes.
The cache key hashes every byte that goes into the build, so an edited source or another
compiler gets a fresh library and two versions never share one.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


def cache_dir(kind: str) -> Path:
    base = os.environ.get("EXPERTMESH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "expertmesh"
    )
    return Path(base) / kind


def build_cached(
    name: str,
    kind: str,
    sources: Sequence[Path],
    flags: Sequence[str],
    key_sources: Sequence[Path] | None = None,
    libs: Sequence[str] = (),
) -> Path:
    """``{name}-{key}.so`` in the cache folder ``kind``, compiled from ``sources`` with ``flags`` (or the
    cached build); ``key_sources``: every file the build reads (default ``sources``: a source
    that includes others lists them here). Raises OSError (no compiler) or
    CalledProcessError (its stderr says why)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc/gcc) on PATH")
    src = b"".join(p.read_bytes() for p in (key_sources if key_sources is not None else sources))
    key = hashlib.sha256(src + cc.encode() + " ".join(flags).encode() + platform.machine().encode())
    out = cache_dir(kind) / f"{name}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [cc, *flags, "-o", str(tmp_so), *map(str, sources), *libs]
        subprocess.run(cmd, check=True, capture_output=True)
        os.replace(tmp_so, out)  # atomic: two processes never load a half-written file
    return out
