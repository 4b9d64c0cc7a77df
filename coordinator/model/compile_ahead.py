"""The in-process decode step's Triton kernels compiled by a helper process while the weights
load: this side starts the helper, reads its progress and ends it (its process:
coordinator/compile_helper.py). Nothing here imports torch: :func:`start` runs first.

On a machine whose Triton cache is empty, the CUDA coordinator's first warm-up of its decode
graphs compiles every Triton kernel (LLVM, ptxas) and builds each one's C launcher with gcc. In
the coordinator that work shares the GIL with the expert reader threads and with the imports
before them, and it ended ~5 s after the read on a fresh H200 host at Qwen3-30B-A3B widths
(benchmarks/RESULTS.md, "The in-process start"). So :func:`start`, called by the command line
before the coordinator imports torch, starts ``python -m coordinator.compile_helper ARGS`` (the
coordinator's own arguments). That process builds the same model cut after its first MoE layer
(and its first dense layer, where it has them) with zero weights, and zero experts, on the same
device in the same dtype, with a KV cache of as many pages modulo 16 as the coordinator's
(Triton specialises an integer argument on its divisibility by 16, and the page table's width
is the page count), runs every decode bucket's step once in the order of the coordinator's
warm-up, printing each bucket on its standard output once that bucket's kernels are in Triton's
on-disk cache, and exits. The coordinator's warm-up of a bucket waits for that line
(:func:`wait_for`), then finds every kernel it asks for in the cache: nothing compiles twice,
and loading one bucket's kernels overlaps the helper's compiles of the next.

Started only where it can pay: a CUDA ``--device`` with every expert in process (no expert
servers), unless ``--no-compile-ahead``. The helper dies with the coordinator (a parent-death
signal), and skips itself when the GPU lacks the room for the coordinator's weights and KV
cache beside its own. A helper that fails or skips costs nothing but its time: its output ends,
and the coordinator compiles what the cache lacks.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import time

log = logging.getLogger("expertmesh.coordinator")

FLAG = "--no-compile-ahead"
# flags that put experts on servers: the step is then graphed around the dispatches, which this
# helper does not build
_CLUSTER_FLAGS = ("--gpu-server", "--cpu-server", "--placement", "--num-gpu-experts")
# the most seconds the coordinator waits for a helper before stopping it and compiling itself
WAIT_LIMIT_S = 600.0
# a wait longer than this says so in the log, again each time it passes (a cold compile of every
# bucket took 9-14 s on an H200 host)
WAIT_NOTICE_S = 30.0

_helper: subprocess.Popen[bytes] | None = None
_started = 0.0
_warmed: set[int] = set()  # buckets the helper reported compiled
_waited = 0.0  # seconds the coordinator's warm-up spent waiting for them
_partial = b""  # the helper's output after its last whole line


def wanted(argv: list[str]) -> bool:
    """Whether the coordinator's arguments ``argv`` are a start this helper speeds up."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--device", default="cpu")
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument(FLAG, action="store_true")
    for flag in _CLUSTER_FLAGS:
        p.add_argument(flag, action="append")
    try:
        args, _ = p.parse_known_args(argv)
    except SystemExit:  # NOTE: a malformed command line: the real parser says what is wrong
        return False
    if args.help or args.no_compile_ahead or not args.device.startswith("cuda"):
        return False
    return not any(getattr(args, f[2:].replace("-", "_")) for f in _CLUSTER_FLAGS)


def _die_with_parent() -> None:  # in the child, between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the coordinator's stop() still ends it
        pass


def command(argv: list[str]) -> list[str]:
    """The helper's command line for the coordinator arguments ``argv``."""
    return [sys.executable, "-m", "coordinator.compile_helper", *argv]


def start(argv: list[str]) -> None:
    """Starts the helper for the coordinator arguments ``argv`` where it pays (:func:`wanted`)."""
    global _helper, _started
    if _helper is not None or not wanted(argv):
        return
    try:
        _helper = subprocess.Popen(
            command(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # one line per compiled bucket; its log goes to stderr
            bufsize=0,  # NOTE: read with os.read beside select: no buffer may hide a line
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
        )
    except OSError as e:
        print(f"compiling the decode kernels in this process: no helper ({e})", file=sys.stderr, flush=True)
        return
    _started = time.monotonic()


def running() -> bool:
    return _helper is not None and _helper.poll() is None


def wait_for(bucket: int, limit_s: float = WAIT_LIMIT_S) -> None:
    """Returns once the helper compiled ``bucket``'s kernels, ended, or took ``limit_s`` (then
    it is stopped); at once without a helper."""
    global _waited, _partial
    if _helper is None or bucket in _warmed:
        return
    assert _helper.stdout is not None
    fd = _helper.stdout.fileno()
    t0 = time.monotonic()
    deadline = t0 + limit_s
    while bucket not in _warmed:
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("kernel compile helper still running after %.0f s: stopped, compiling here", limit_s)
            stop()
            return
        if not select.select([fd], [], [], min(left, WAIT_NOTICE_S))[0]:
            if left > WAIT_NOTICE_S:
                log.info(
                    "waiting %.0f s so far for the kernel compile helper (pid %d) to compile batch bucket %d "
                    "(stopped after %.0f s; --no-compile-ahead compiles here)",
                    time.monotonic() - t0,
                    _helper.pid,
                    bucket,
                    limit_s,
                )
            continue
        data = os.read(fd, 4096)
        if not data:  # ended (done, skipped or failed): wait() says how
            _waited += time.monotonic() - t0
            wait()
            return
        *lines, _partial = (_partial + data).split(b"\n")
        _warmed.update(int(x) for x in lines if x.strip().isdigit())
    _waited += time.monotonic() - t0


def wait(limit_s: float = WAIT_LIMIT_S) -> float:
    """Waits for the helper (if one was started) to end; returns the seconds waited."""
    if _helper is None:
        return 0.0
    t0 = time.monotonic()
    try:
        rc = _helper.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        log.warning("kernel compile helper still running after %.0f s: stopped, compiling here", limit_s)
        stop()
        return time.monotonic() - t0
    waited = time.monotonic() - t0
    log.info(
        "kernel compile helper (pid %d) %s %.1f s after the start; the warm-up waited %.1f s for its kernels",
        _helper.pid,
        "ended" if rc == 0 else f"failed (exit {rc}): compiling what it left out here,",
        time.monotonic() - _started,
        _waited + waited,
    )
    _forget()
    return waited


def stop() -> None:
    """Ends the helper if it still runs (the coordinator's exit, or a wait that ran out)."""
    if _helper is None:
        return
    if _helper.poll() is None:
        _helper.terminate()
        try:
            _helper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _helper.kill()
            _helper.wait()
    _forget()


def _forget() -> None:
    global _helper, _waited, _partial
    if _helper is not None and _helper.stdout is not None:
        _helper.stdout.close()
    _helper, _waited, _partial = None, 0.0, b""
    _warmed.clear()


def cut_pages(num_pages: int) -> int:
    """A page count no larger than 64 + 15 that Triton specialises like ``num_pages``: the same
    remainder modulo 16, and 1 only for 1."""
    return num_pages if num_pages <= 64 else 48 + num_pages % 16
