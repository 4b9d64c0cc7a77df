"""Shared libraries built from C sources on first use with the system C compiler, cached per
source, compiler, flags and machine (the CPU expert kernels, the TCP relay, the delay proxy).

The C needs no Python or torch headers, so a build takes seconds; it is called through ctypes.
The cache key hashes every byte that goes into the build, so an edited source or another
compiler gets a fresh library and two versions never share one.
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
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger("expertmesh.cbuild")


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


class CachedLibrary:
    """One C library of this package, built (:func:`build_cached`) and loaded on first use, once
    per process; ``declare`` sets its functions' ctypes signatures. Where it cannot be built
    (no compiler, a compile error) :meth:`load` gives None and :meth:`unavailable` says why,
    logged once, so callers fall back instead of failing."""

    def __init__(
        self,
        what: str,  # "the TCP relay": how messages name it
        name: str,
        sources: Sequence[Path],
        flags: Sequence[str],
        declare: Callable[[ctypes.CDLL], None],
        use_errno: bool = False,
    ) -> None:
        self.what, self.name, self.sources, self.flags = what, name, tuple(sources), list(flags)
        self._declare, self._use_errno = declare, use_errno
        self._lib: ctypes.CDLL | None = None
        self._why = ""
        self._lock = threading.Lock()

    def build(self) -> Path:
        """The library's path (compiled now or cached); raises OSError / CalledProcessError."""
        return build_cached(self.name, self.name, self.sources, self.flags)

    def load(self) -> ctypes.CDLL | None:
        with self._lock:
            if self._lib is not None or self._why:
                return self._lib
            try:
                lib = ctypes.CDLL(str(self.build()), use_errno=self._use_errno)
            except (OSError, subprocess.CalledProcessError) as e:
                detail = ""
                if isinstance(e, subprocess.CalledProcessError):
                    detail = e.stderr.decode(errors="replace")[-500:]
                self._why = f"{self.what} cannot be built here: {e} {detail}".strip()
                log.warning("%s", self._why)
                return None
            self._declare(lib)
            self._lib = lib
            return lib

    def unavailable(self) -> str:
        """Why there is no library here ("" where :meth:`load` gives one)."""
        self.load()
        return self._why
