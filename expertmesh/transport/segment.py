"""Named shared-memory segments and doorbell FIFOs in ``/dev/shm``, and the janitor that removes
the ones a dead process left behind.

Names are ``expertmesh-<pid>-<start>-<random>`` (plus ``.req`` / ``.resp`` for the two FIFOs),
where ``pid`` and ``start`` (the creator's start time in clock ticks since boot, field 22 of
``/proc/<pid>/stat``) identify the creating process even after its pid is reused.

Lifetime: the coordinator creates the segment and the FIFOs, the expert server opens them and
unlinks the names at once, and the coordinator unlinks them too when the handshake ends, either
way. From then on the mapping and the pipe ends live exactly as long as the two processes hold
them, so a kill -9 of either side leaves nothing in ``/dev/shm``. Only a crash inside the
handshake (milliseconds) can leave names behind; :func:`sweep`, run when a coordinator opens a
channel and when an expert server starts, removes those whose creator is gone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "expertmesh-"
FIFO_SUFFIXES = (".req", ".resp")
_NAME = re.compile(r"^expertmesh-(\d+)-(\d+)-([0-9a-f]{16})$")
_ANY = re.compile(r"^expertmesh-(\d+)-(\d+)-[0-9a-f]{16}(\.req|\.resp)?$")


class SegmentError(OSError):
    """A segment that cannot be created, opened or checked."""


def available(shm_dir: Path = SHM_DIR) -> bool:
    """Whether this host has a shared-memory directory we can create segments in."""
    return shm_dir.is_dir() and os.access(shm_dir, os.W_OK | os.X_OK)


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def new_name() -> str:
    pid = os.getpid()
    return f"{PREFIX}{pid}-{process_start(pid) or 0}-{secrets.token_hex(8)}"


def is_segment_name(name: object) -> bool:
    """One of ours: no path, no traversal, nothing else in /dev/shm."""
    return isinstance(name, str) and _NAME.match(name) is not None


def check_name(name: str) -> str:
    if not is_segment_name(name):
        raise ValueError(f"{name!r} is not an expertmesh segment name")
    return name


def create(name: str, size: int, shm_dir: Path = SHM_DIR) -> mmap.mmap:
    """Creates segment ``name`` of ``size`` bytes (memory reserved up front: a full /dev/shm
    fails here with ENOSPC instead of a SIGBUS at the first write) and its two FIFOs."""
    path = shm_dir / check_name(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
        for suffix in FIFO_SUFFIXES:
            os.mkfifo(shm_dir / (name + suffix), 0o600)
    except OSError:
        os.close(fd)
        unlink(name, shm_dir)
        raise
    os.close(fd)
    return mm


def attach(name: str, size: int, shm_dir: Path = SHM_DIR) -> mmap.mmap:
    """Maps an existing segment, checking that it has the announced size."""
    path = shm_dir / check_name(name)
    fd = os.open(path, os.O_RDWR)
    try:
        have = os.fstat(fd).st_size
        if have != size:
            raise SegmentError(f"segment {name} has {have} bytes, {size} announced")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def open_fifos(name: str, shm_dir: Path = SHM_DIR) -> tuple[int, int]:
    """(request, response) FIFO descriptors, both opened read-write.

    NOTE: O_RDWR never blocks on Linux (no waiting for the other end), and holding both ends
    lets a process wake its own reader (a close kick) through the FIFO it reads.
    """
    fds: list[int] = []
    try:
        for suffix in FIFO_SUFFIXES:
            fds.append(os.open(shm_dir / (check_name(name) + suffix), os.O_RDWR))
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], fds[1]


def unlink(name: str, shm_dir: Path = SHM_DIR) -> None:
    """Removes the segment's name and its FIFOs' (missing ones are fine)."""
    for suffix in ("", *FIFO_SUFFIXES):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_dir / (name + suffix))


def ours(shm_dir: Path = SHM_DIR) -> list[str]:
    """Every expertmesh entry in ``shm_dir`` (segments and FIFOs)."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if _ANY.match(n))
    except FileNotFoundError:
        return []


def sweep(shm_dir: Path = SHM_DIR, min_age_s: float = 5.0) -> list[str]:
    """Removes entries whose creating process is gone (or whose pid now names another process).

    Entries younger than ``min_age_s`` are kept: a creator in another pid namespace would look
    dead from here, and its handshake lasts milliseconds.
    """
    removed = []
    now = time.time()
    for name in ours(shm_dir):
        m = _ANY.match(name)
        assert m is not None
        pid, start = int(m.group(1)), int(m.group(2))
        if process_start(pid) == start:
            continue
        try:
            if now - os.lstat(shm_dir / name).st_mtime < min_age_s:
                continue
            os.unlink(shm_dir / name)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
