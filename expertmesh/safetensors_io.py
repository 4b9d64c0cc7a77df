"""Reading safetensors byte ranges straight into their destination tensor.

``safe_open(...).get_tensor`` maps the file and copies the tensor into a new one; the mapped
pages stay in the process's resident set for as long as the handle lives (a server that loaded
60 GB of experts shows 60 GB more RSS than it holds), and a caller that wants the weights
elsewhere (a packed slot, a GPU) copies them again. Here a tensor's bytes are read with
``preadv`` from the page cache into the destination's own memory when its dtype and layout
match, else into a per-thread staging buffer (pinned when the destination is on a GPU) and
copied once, converting the dtype on the way. ``preadv`` releases the GIL, so reader threads
run in parallel: :meth:`TensorFile.pieces` splits big tensors into pieces of at most
:data:`PIECE_BYTES` that several threads read (:func:`run_on`), which is what makes a load
reach the page cache's speed: one thread spends most of its time faulting in the destination's fresh
pages (2 GB/s into fresh pages against 13 GB/s into pages already there, on the 2-core VM of
benchmarks/RESULTS.md), and a GPU destination's pieces overlap their host-to-device copies
with the next reads.

The format: 8 bytes little-endian header size N, N bytes of JSON ``{name: {dtype, shape,
data_offsets: [begin, end]}}`` (offsets after the header), then the data.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
import os
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

T = TypeVar("T")
log = logging.getLogger("expertmesh.checkpoint")

# safetensors' dtype names -> torch
ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20
_IOV_MAX = 1024  # Linux's limit on buffers per preadv
# a destination made of more runs than this, or of runs shorter than this many bytes, goes
# through the staging buffer instead (a syscall's buffers cost more than a copy then)
_MAX_RUNS, _MIN_RUN = 4096, 4096
# the most bytes one thread reads at a time from a tensor: also its staging buffer's size
# (pinned for a GPU, and kept by torch's pinned-memory cache: 16 threads hold 128 MB)
PIECE_BYTES = 8 << 20
# reader threads of a load: page faults and the page cache's copies scale to about this many
MAX_READ_THREADS = 16


@dataclass(frozen=True)
class TensorSpan:
    """Where one stored tensor's bytes are: file offset, dtype, shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class TensorFile:
    """One safetensors file opened for positional reads (one descriptor, any thread)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            if n > _MAX_HEADER:
                raise ValueError(f"{path}: safetensors header of {n} bytes")
            header = json.loads(os.pread(self.fd, n, 8))
        except BaseException:
            os.close(self.fd)
            raise
        self._close = weakref.finalize(self, os.close, self.fd)
        self.spans: dict[str, TensorSpan] = {}
        for name, v in header.items():
            if name == "__metadata__" or v["dtype"] not in ST_DTYPES:
                continue  # NOTE: dtypes torch lacks stay on safe_open's path (which refuses them)
            begin, _ = v["data_offsets"]
            self.spans[name] = TensorSpan(8 + n + begin, ST_DTYPES[v["dtype"]], tuple(v["shape"]))

    def read_into(self, span: TensorSpan, out: torch.Tensor, index: int | None = None) -> int:
        """Copies the stored tensor (``index``: its ``[index]`` slice) into ``out``: any dtype,
        layout or device, and its shape or any other with the same elements in the same
        row-major order (a [I, H] matrix into [I/B, B, H] blocks); returns the bytes read. A big
        tensor goes in pieces, so a staging buffer never exceeds :data:`PIECE_BYTES`."""
        return sum(p.read() for p in self.pieces(span, out, index))

    def pieces(
        self, span: TensorSpan, out: torch.Tensor, index: int | None = None, max_bytes: int | None = None
    ) -> list[Piece]:
        """:meth:`read_into` as pieces of at most ``max_bytes`` stored bytes (default
        :data:`PIECE_BYTES`; 0: one piece) that any threads may read in any order: runs of a
        contiguous ``out``'s elements."""
        max_bytes = PIECE_BYTES if max_bytes is None else max_bytes
        shape = span.shape if index is None else span.shape[1:]
        n = math.prod(shape)
        assert out.numel() == n, f"{out.shape=} {shape=}"
        es = span.dtype.itemsize
        offset = span.offset if index is None else span.offset + index * n * es
        if max_bytes <= 0 or n * es <= max_bytes or not out.is_contiguous():
            return [Piece(self, offset, span.dtype, out, 1)]
        flat, step = out.view(-1), max(1, max_bytes // es)
        return [
            Piece(self, offset + a * es, span.dtype, flat[a : a + step], int(a == 0))
            for a in range(0, n, step)
        ]

    def _read_at(self, offset: int, dtype: torch.dtype, out: torch.Tensor) -> int:
        """Reads ``out.numel()`` stored ``dtype`` elements from byte ``offset`` into ``out``."""
        nbytes = out.numel() * dtype.itemsize
        runs = _runs(out) if out.device.type == "cpu" and out.dtype == dtype else None
        if runs is not None:  # straight into out's memory, scattered over its blocks
            self._pread(offset, runs)
            return nbytes
        buf = _staging(nbytes, out.device.type == "cuda")
        self._pread(offset, [(buf.data_ptr(), nbytes)])
        src = buf[:nbytes].view(dtype).view(out.shape)
        if out.device.type != "cuda":
            out.copy_(src)
            return nbytes
        # NOTE: this thread's own stream: the default stream would also wait for (and hold up)
        # the forwards a prepare runs beside; done before the buffer is reused
        stream = _stream(out.device)
        with torch.cuda.stream(stream):
            out.copy_(src, non_blocking=True)
        stream.synchronize()
        return nbytes

    def _pread(self, offset: int, runs: list[tuple[int, int]]) -> None:
        """Reads consecutive file bytes from ``offset`` into ``runs`` (address, length)."""
        views = [memoryview((ctypes.c_char * n).from_address(ptr)).cast("B") for ptr, n in runs]
        while views:
            batch = views[:_IOV_MAX]
            want = sum(len(v) for v in batch)
            got = os.preadv(self.fd, batch, offset)
            if got <= 0:
                raise OSError(f"{self.path}: short read at byte {offset} ({want} bytes wanted)")
            offset += got
            # drop what was read (a short read can stop inside a buffer)
            while views and got >= len(views[0]):
                got -= len(views[0])
                views.pop(0)
            if got:
                views[0] = views[0][got:]

    def close(self) -> None:
        self._close()


@dataclass(frozen=True)
class Piece:
    """A run of one stored tensor's elements and where they go (TensorFile.pieces)."""

    file: TensorFile
    offset: int  # file byte of the first element
    dtype: torch.dtype  # as stored
    out: torch.Tensor  # any dtype, layout or device; numel() elements
    tensors: int  # 1 for a tensor's first piece (progress counts tensors), else 0

    def read(self) -> int:
        """Reads the piece; returns the stored bytes read."""
        return self.file._read_at(self.offset, self.dtype, self.out)


def read_threads(limit: int = MAX_READ_THREADS) -> int:
    """Reader threads for a load: this process's CPUs, at most ``limit`` (or at most
    ``EXPERTMESH_READ_THREADS`` where set: a benchmark's knob)."""
    limit = int(os.environ.get("EXPERTMESH_READ_THREADS", limit))
    return max(1, min(limit, len(os.sched_getaffinity(0))))


# how much nicer than the process background readers are (a placement change read beside
# requests): the scheduler gives a busy compute thread about ten times their share of a core,
# idle cores are theirs
BACKGROUND_NICE = 10


def reader_pool(threads: int, background: bool = False) -> ThreadPoolExecutor:
    """Threads for checkpoint reads; ``background``: at a lower CPU priority, for reads beside
    requests (a compute thread preempted by a reader stalls its whole OpenMP team at the next
    barrier, so on a server's own cores the reads would cost steps many times their CPU)."""
    # NOTE: a reader's dtype conversions and packing run on its own thread only: torch's
    # OpenMP team per calling thread would put n x cores threads on the cores
    init = background_thread if background else _one_thread_here
    return ThreadPoolExecutor(threads, "checkpoint-read", initializer=init)


def background_thread() -> None:
    """This thread (a pool's initializer) at the background priority, its torch ops on one
    thread: work beside requests that must not take their cores."""
    _one_thread_here()
    try:  # NOTE: on Linux a thread is a task: its own nice value, no privilege needed to raise it
        tid = threading.get_native_id()
        # relative to the process (its main thread), not to the thread that started this one:
        # a pool started from a background thread would otherwise add the offset twice
        want = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + BACKGROUND_NICE)
        if os.getpriority(os.PRIO_PROCESS, tid) < want:
            os.setpriority(os.PRIO_PROCESS, tid, want)
    except (OSError, AttributeError) as e:
        log.info("background checkpoint reads at normal priority: %s", e)


def _one_thread_here() -> None:
    """This thread's torch ops on one thread, every other thread's as they were.

    ``torch.set_num_threads`` would also set the count that every thread started afterwards
    takes (a server's compute threads, the coordinator's scheduler would then run on one
    thread, whatever ``--threads`` said); OpenMP's own setting is the calling thread's only."""
    torch.get_num_threads()  # NOTE: first: torch's lazy per-thread set-up would overwrite ours
    fn = _omp_set_num_threads()
    if fn is not None:
        fn(1)
    else:  # another OpenMP runtime: one thread here, and the count of later threads with it
        torch.set_num_threads(1)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch's CPU ops use (the one under torch's
    own lib/ directory), or None (another runtime)."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return None
    ours = sorted(p for p in paths if p.startswith(lib_dir))
    if not ours:
        return None
    fn = ctypes.CDLL(ours[0]).omp_set_num_threads
    fn.argtypes, fn.restype = [ctypes.c_int], None
    return cast(Callable[[int], None], fn)


def run_on(pool: ThreadPoolExecutor | None, jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Runs ``jobs`` on ``pool`` (on this thread without one, or for one job); the first
    failure is raised once the jobs under way have ended, and no job starts after it."""
    if pool is None or len(jobs) <= 1:
        return [j() for j in jobs]
    failed = threading.Event()

    def guarded(job: Callable[[], T]) -> Callable[[], T | None]:
        def run() -> T | None:
            if failed.is_set():
                return None
            try:
                return job()
            except BaseException:
                failed.set()
                raise

        return run

    futures = [pool.submit(guarded(j)) for j in jobs]
    wait(futures, return_when=FIRST_EXCEPTION)
    for f in futures:
        f.cancel()
    wait(futures)
    for f in futures:
        error = None if f.cancelled() else f.exception()
        if error is not None:
            raise error
    # NOTE: no failure, so every job ran and returned its own result
    return [cast(T, f.result()) for f in futures]


def _runs(out: torch.Tensor) -> list[tuple[int, int]] | None:
    """``out``'s memory as contiguous runs (address, bytes) in its row-major order: one for a
    contiguous tensor, one per block for a blocked view (interleaved gate/up rows); None when
    the runs would be too many or too short."""
    shape, strides, es = out.shape, out.stride(), out.element_size()
    k, run = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    outer = shape[:k]
    n = math.prod(outer)
    if n == 1:
        return [(out.data_ptr(), run * es)]
    if n > _MAX_RUNS or run * es < _MIN_RUN:
        return None
    base = out.data_ptr()
    offsets = [0]
    for size, stride in zip(outer, strides[:k]):
        offsets = [o + i * stride * es for o in offsets for i in range(size)]
    return [(base + o, run * es) for o in offsets]


_local = threading.local()


def _stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's copy stream on ``device``."""
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    s = streams.get(device)
    if s is None:
        s = streams[device] = torch.cuda.Stream(device)
    return s


def _staging(nbytes: int, pinned: bool) -> torch.Tensor:
    """This thread's staging buffer of at least ``nbytes`` (a piece, or one expert tensor
    read into a blocked view: a few MB)."""
    key = "pinned" if pinned else "plain"
    buf = getattr(_local, key, None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        setattr(_local, key, buf)
    return buf
