"""What an expert server's memory really holds: freed weights handed back, resident and peak
bytes read from the process and the device.

After a placement change the old weights are garbage, but torch's CUDA caching allocator keeps
their blocks reserved and glibc keeps freed heap pages mapped, so ``nvidia-smi`` and RSS would
still show them. :func:`release` gives both back.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import sys
import threading
from collections.abc import Iterator

import torch

log = logging.getLogger("expertmesh.worker")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") else None  # glibc only (not musl)


# NOTE: the CUDA caching allocator must not free its reserve while a graph is being captured in
# the process, whichever thread frees (PyTorch raises, or the capture breaks); an expert server
# captures on its compute thread and releases on its loader thread, so the two take turns
_CAPTURE = threading.Lock()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Held around a CUDA graph capture: :func:`release` waits for it."""
    with _CAPTURE:
        yield


def release(device: torch.device) -> None:
    """Returns freed memory: the CUDA allocator's unused reserve on ``device``, and the host
    heap's free pages (glibc ``malloc_trim``; big tensors are their own mappings and go back
    when freed, smaller ones sit in the heap)."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        with _CAPTURE, torch.cuda.device(device):
            torch.cuda.empty_cache()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


# Linux madvise advice: drop the pages (anonymous memory reads as zeros after), and (5.14 and
# later) fault the range in now, writable
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_PAGE = 4096
# NOTE: unmapping a freed layer in one piece (hundreds of MB) slowed an expert server's steps by
# tens of milliseconds after each commit (measured); returning the pages this much at a time
# before the free did not. Our reading: one call holds the process's memory-map lock throughout,
# and a serving thread that maps memory meanwhile (a new buffer, Python's own arenas) waits
RELEASE_CHUNK = 32 << 20


def _madvise(start: int, length: int, advice: int) -> bool:
    libc = _libc()
    if libc is None:
        return False
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn(start, length, advice) == 0


def _whole_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """The page-aligned range inside [ptr, ptr + nbytes) (a neighbour may share the edge pages)."""
    return -(-ptr // _PAGE) * _PAGE, (ptr + nbytes) // _PAGE * _PAGE


def sole_storages(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(address, bytes) of each host storage that nothing outside ``tensors`` holds: no tensor or
    view elsewhere (each holds its storage once in the storage's use count), no storage object
    held elsewhere (one Python object per storage: its references beyond ours)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return []
    seen: set[int] = set()
    holders: dict[int, list] = {}  # storage address -> [storage object, tensors here holding it]
    probe = torch.empty(1)  # a storage nothing else holds, counted the same way
    for t in [probe, *tensors]:
        if id(t) in seen or t.device.type != "cpu":
            continue
        seen.add(id(t))
        st = t.untyped_storage()
        if st.nbytes() == 0:
            continue
        holders.setdefault(st.data_ptr(), [st, 0])[1] += 1
    del st
    own = _refs(holders[probe.untyped_storage().data_ptr()])
    del holders[probe.untyped_storage().data_ptr()]
    return [
        (ptr, entry[0].nbytes())
        for ptr, entry in holders.items()
        if use_count(entry[0]._cdata) == entry[1] + 1 and _refs(entry) == own
    ]


def _refs(entry: list) -> int:
    """References to a holders entry's storage object (the same code path for every entry)."""
    return sys.getrefcount(entry[0])


def drop_pages(tensors: list[torch.Tensor]) -> int:
    """Returns to the OS the pages of the host storages that ``tensors`` alone hold (about to be
    freed), :data:`RELEASE_CHUNK` at a time, so that freeing them after costs nothing; bytes
    returned. What else holds, or where madvise is unavailable, is left to the free."""
    done = 0
    for ptr, nbytes in sole_storages(tensors):
        start, end = _whole_pages(ptr, nbytes)
        while start < end:
            n = min(RELEASE_CHUNK, end - start)
            if not _madvise(start, n, _MADV_DONTNEED):
                return done
            start, done = start + n, done + n
    return done


def populate(t: torch.Tensor) -> bool:
    """Faults in the whole pages inside a host tensor about to be written for the first time
    (a new slot before the checkpoint is read into it), in one madvise call instead of one
    fault per 4 KB page taken in the middle of the copy. Measured on a 2-core VM with a bf16
    load: about a quarter less kernel time outside the pages' zeroing (the zeroing stays).
    False where it does not apply (not glibc, before Linux 5.14): the writes fault as before."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return False
    start, end = _whole_pages(t.data_ptr(), t.nbytes)
    return end > start and _madvise(start, end - start, _MADV_POPULATE_WRITE)


def huge_pages(t: torch.Tensor) -> bool:
    """Asks for transparent huge pages under a host tensor not written yet (a new layer's
    expert weights), where the kernel leaves them to madvise. Why: a decode layer's kernels
    stream tens of MB of weights spread over many slots; with 4 KB pages every 4 KB of a row is
    a TLB miss. False where it does not apply (THP off, not Linux): the pages stay 4 KB."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return False
    start, end = _whole_pages(t.data_ptr(), t.nbytes)
    return end > start and _madvise(start, end - start, _MADV_HUGEPAGE)


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def process_rss_bytes() -> int:
    """Resident set of this process now (0 where /proc is unavailable)."""
    return _status_kib("VmRSS") * 1024


def process_peak_rss_bytes() -> int:
    """The largest resident set this process has had (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def device_bytes(device: torch.device) -> tuple[int, int]:
    """(allocated now, peak allocated) by torch on a CUDA ``device``; (0, 0) elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
