"""NUMA memory of a byte range: ask that its pages live on one node (``mbind``), and read back
where they are (``move_pages`` in query mode). Linux syscalls through ctypes (glibc exports
neither; libnuma would be a new dependency for two calls).

Why ``MPOL_PREFERRED`` and not ``MPOL_BIND``: a preference falls back to another node when the
preferred one is full instead of failing the allocation; the pages a server touches right after
the call (the expert weights it copies in) still land on the node. ``MPOL_MF_MOVE`` also migrates
the pages of the range that already exist (memory the allocator reused).

Kernels and sandboxes may refuse both calls (Docker's default seccomp profile allows them only
with ``CAP_SYS_NICE``; gVisor implements few NUMA calls; a node id the host lacks is EINVAL):
the callers catch :class:`NumaMemoryError`, log it and rely on first touch from a thread
pinned to the node.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform

MPOL_PREFERRED = 1
MPOL_MF_MOVE = 1 << 1
# (mbind, move_pages) per machine; other architectures: no memory policy, first touch only
SYSCALLS = {"x86_64": (237, 279), "aarch64": (235, 239)}
MAX_QUERY_PAGES = 4096  # where_are() samples at most this many pages of a range


class NumaMemoryError(OSError):
    """A memory-policy call the kernel (or the sandbox) refused."""


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def page_size() -> int:
    return os.sysconf("SC_PAGESIZE")


def _syscall(index: int, name: str, *args: object) -> int:
    nrs = SYSCALLS.get(platform.machine())
    if nrs is None:
        raise NumaMemoryError(errno.ENOSYS, f"{name}: no syscall number known for {platform.machine()}")
    rc = _libc().syscall(ctypes.c_long(nrs[index]), *args)
    if rc < 0:
        err = ctypes.get_errno()
        raise NumaMemoryError(err, f"{name}: {os.strerror(err)}")
    return rc


def inner_pages(addr: int, nbytes: int) -> tuple[int, int]:
    """The whole pages inside ``[addr, addr + nbytes)``: (first page address, page count). The
    partial pages at either end are shared with neighbouring data and left alone."""
    ps = page_size()
    start = -(-addr // ps) * ps
    end = (addr + nbytes) // ps * ps
    return start, max(0, (end - start) // ps)


def prefer_node(addr: int, nbytes: int, node: int) -> int:
    """Sets ``MPOL_PREFERRED`` on ``node`` for the whole pages of the range and moves those that
    exist there. Returns the pages covered; raises NumaMemoryError when refused."""
    start, n = inner_pages(addr, nbytes)
    if n == 0:
        return 0
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    # NOTE: maxnode counts one more than the mask's bits (the kernel reads maxnode - 1 of them)
    maxnode = ctypes.c_ulong(len(mask) * bits + 1)
    _syscall(
        0, "mbind", ctypes.c_void_p(start), ctypes.c_ulong(n * page_size()), ctypes.c_int(MPOL_PREFERRED),
        mask, maxnode, ctypes.c_uint(MPOL_MF_MOVE),
    )  # fmt: skip
    return n


def where_are(addr: int, nbytes: int, max_pages: int = MAX_QUERY_PAGES) -> list[int]:
    """The node of the range's whole pages (evenly sampled down to ``max_pages``); an entry < 0
    is ``-errno`` for that page (``-ENOENT``: not yet touched). Raises NumaMemoryError when the
    kernel refuses the query."""
    start, n = inner_pages(addr, nbytes)
    if n == 0:
        return []
    step = max(1, -(-n // max_pages))
    idx = range(0, n, step)
    ps = page_size()
    pages = (ctypes.c_void_p * len(idx))(*(start + i * ps for i in idx))
    status = (ctypes.c_int * len(idx))()
    # nodes = NULL: query only, nothing moves
    _syscall(1, "move_pages", ctypes.c_int(0), ctypes.c_ulong(len(idx)), pages, None, status, ctypes.c_int(0))
    return list(status)
