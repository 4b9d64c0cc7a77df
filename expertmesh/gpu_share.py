"""Whether other processes run kernels on a GPU, read from NVML (the driver's management library,
loaded with ctypes: no Python package needed).

A linked decode step (coordinator/model/remote_graphs.py) spins on its GPU until the expert
server's answer arrives. Two processes with CUDA contexts on one GPU are time-sliced by the
driver (no MPS): while one process's graph spins, the other's kernels wait for the slice to end.
Two coordinators on one GPU, each spinning on its link, measured 441 -> 45 tok/s at
concurrency 8 (full-size Qwen3-30B-A3B, 2x H200: benchmarks/RESULTS.md). So in the link's
``auto`` mode a coordinator stands its link down while its GPU has other compute processes,
and takes it up again when they have gone.

What counts is processes that ran kernels in the last second (NVML's per-process SM
utilisation samples), not processes that hold a context: a context alone does not time-slice
anything, and a process can hold a stray one (pinning memory from a thread whose current GPU
is 0 creates a context there, whichever GPU the process computes on). The count includes this process: NVML reports
host PIDs, which inside a container are not ours to compare with, so "shared" is two or more
busy processes, not "a busy PID other than mine".
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)

NVML_SUCCESS = 0
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
MAX_SAMPLES = 256


class _UtilSample(ctypes.Structure):
    # nvmlProcessUtilizationSample_t
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),  # CPU time, microseconds since the epoch
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    ]


class Nvml:
    """The few NVML calls this needs. Raises OSError where the library or the device is missing."""

    _lock = threading.Lock()
    _lib: ctypes.CDLL | None = None

    def __init__(self) -> None:
        with Nvml._lock:
            if Nvml._lib is None:
                lib = ctypes.CDLL("libnvidia-ml.so.1")
                self._check(lib.nvmlInit_v2(), "nvmlInit")
                Nvml._lib = lib
        self.lib = Nvml._lib
        self._util = self.lib.nvmlDeviceGetProcessUtilization  # AttributeError: an NVML without it

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != NVML_SUCCESS:
            raise OSError(f"NVML {what} returned {rc}")

    def handle(self, uuid: str) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        # NOTE: torch spells the UUID without NVML's "GPU-" prefix
        key = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        self._check(self.lib.nvmlDeviceGetHandleByUUID(key.encode(), ctypes.byref(h)), "GetHandleByUUID")
        return h

    def busy_processes(self, handle: ctypes.c_void_p, window_s: float) -> int:
        """Processes with SM utilisation above 0 in a sample of the last ``window_s`` seconds."""
        since = int((time.time() - window_s) * 1e6)
        size = MAX_SAMPLES
        while True:
            n = ctypes.c_uint(size)
            samples = (_UtilSample * size)()
            rc = self._util(handle, samples, ctypes.byref(n), ctypes.c_ulonglong(since))
            if rc == NVML_ERROR_NOT_FOUND:  # no sample since then: nothing ran
                return 0
            if rc == NVML_ERROR_INSUFFICIENT_SIZE and size < 16 * MAX_SAMPLES:
                size *= 4
                continue
            self._check(rc, "GetProcessUtilization")
            return len({samples[i].pid for i in range(n.value) if samples[i].smUtil > 0})


def nvml_counter(uuid: str, window_s: float = 1.0) -> Callable[[], int]:
    """A function returning how many processes ran kernels on the GPU ``uuid`` in the last
    ``window_s`` seconds (OSError: NVML is not there, or does not know the device)."""
    nvml = Nvml()
    handle = nvml.handle(uuid)
    return lambda: nvml.busy_processes(handle, window_s)


class ShareProbe:
    """Answers "do other processes run kernels on this GPU?" from a count at most ``ttl_s``
    old. The question is asked every decode step; NVML's samples take up to milliseconds to
    read, so with ``background`` a daemon thread refreshes the answer (started by the first
    question, ended when the probe is gone) and a step only reads it; without, the question
    itself counts when the answer is older than ``ttl_s``."""

    def __init__(
        self,
        count: Callable[[], int] | None,
        ttl_s: float = 2.0,
        clock=time.monotonic,
        background: bool = False,
    ) -> None:
        self._count, self.ttl_s, self._clock, self._background = count, ttl_s, clock, background
        self._at = -float("inf")
        self._why = ""
        self._thread: threading.Thread | None = None

    @classmethod
    def for_device(cls, uuid: str, ttl_s: float = 2.0) -> ShareProbe:
        """A probe of the GPU ``uuid``, refreshed in the background; one that never reports
        sharing where NVML cannot tell (logged once: the link then behaves as without it)."""
        try:
            return cls(nvml_counter(uuid), ttl_s, background=True)
        except (OSError, AttributeError) as e:
            log.info("cannot count the processes on GPU %s (%s): the device link does not stand "
                     "down for other processes there", uuid, e)  # fmt: skip
            return cls(None, ttl_s)

    def shared(self) -> str:
        """Why this GPU counts as shared now ("" when it does not)."""
        if self._count is None:
            return ""
        if self._background:
            if self._thread is None:
                self._refresh()  # the first answer is a fresh one
                self._thread = threading.Thread(
                    target=_refresher, args=(weakref.ref(self), self.ttl_s), daemon=True, name="gpu-share"
                )
                self._thread.start()
            return self._why
        if self._clock() - self._at >= self.ttl_s:
            self._refresh()
        return self._why

    def _refresh(self) -> None:
        self._at = self._clock()
        count = self._count
        if count is None:
            return
        try:
            n = count()
        except OSError as e:  # NOTE: e.g. a driver without per-process samples: asked once
            log.warning("counting the busy processes on this GPU failed (%s): the link no longer "
                        "stands down for them", e)  # fmt: skip
            self._count, n = None, 1
        self._why = (
            f"{n} processes run kernels on this GPU: a spinning linked step would time-slice it "
            "with the others (EXPERTMESH_LINK=force links anyway)"
            if n >= 2
            else ""
        )


def _refresher(ref: weakref.ref[ShareProbe], ttl_s: float) -> None:
    """The background probe's loop: holds no reference to it between refreshes, so a probe
    that is dropped ends its thread within ``ttl_s``."""
    while True:
        time.sleep(ttl_s)
        probe = ref()
        if probe is None or probe._count is None:
            return
        probe._refresh()
        del probe
