"""A pytest plugin (loaded by tests/conftest.py): the session fails when a process it started
outlives it. Every test that starts processes must reap them; one left running (a restarted
expert server nobody stops, say) keeps its port and memory after the suite and is found here,
named, killed, and the exit status turns non-zero.

Linux only (reads ``/proc``); elsewhere it checks nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

GRACE_S = 5.0  # a child told to stop during the last teardown may take a moment to go
# helpers that live exactly as long as this interpreter (they exit with it, never outlive it)
_INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "compile_worker")


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid``, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """Live (not zombie) descendants of ``root``, parents before children."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _stat(int(d.name))) is not None and st[1] != "Z":
            parent[int(d.name)] = st[0]
    out, frontier = [], [root]
    while frontier:
        kids = sorted(p for p, pp in parent.items() if pp in frontier)
        out += kids
        frontier = kids
    return out


def leftovers(root: int, grace_s: float = GRACE_S) -> list[int]:
    """The descendants of ``root`` still alive after ``grace_s``, interpreter helpers aside."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [p for p in descendants(root) if not any(h in cmdline(p) for h in _INTERPRETER_HELPERS)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not Path("/proc/self/stat").exists():
        return
    left = leftovers(os.getpid())
    if not left:
        return
    lines = [f"  pid {p}: {cmdline(p) or '?'}" for p in left]
    for p in reversed(left):  # children first: nothing is re-parented to init and left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = "processes started by the tests outlived the session (now killed):\n" + "\n".join(lines)
    if reporter is not None:
        reporter.write_sep("=", "leaked processes", red=True)
        reporter.write_line(text)
    else:
        print(text)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
