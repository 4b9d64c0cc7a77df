"""Loading progress: a bar on a terminal, periodic log lines otherwise (tensors, bytes, rate)."""

from __future__ import annotations

import io
import logging

from expertmesh.progress import LoadProgress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_when_not_a_terminal(caplog):
    caplog.set_level(logging.INFO, logger="expertmesh.load")
    p = LoadProgress("gpu-server experts", total_bytes=4 << 20, stream=io.StringIO(), log_every_s=0.0)
    for _ in range(4):
        p.add(1 << 20)
    p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, lines  # one per add (log_every_s=0) and the closing one
    assert "4 tensors" in lines[-1] and "of 0.00 GiB (100%)" in lines[-1] and "MiB/s" in lines[-1]
    assert "done in" in lines[-1] and "2 tensors" in lines[1]


def test_bar_on_a_terminal():
    tty = _Tty()
    p = LoadProgress("coordinator weights", total_bytes=10, stream=tty)
    p._last = -1e9  # draw on the next add
    p.add(5)
    p.close()
    out = tty.getvalue()
    assert out.startswith("\r[" + "#" * 15 + "." * 15 + "] coordinator weights: 1 tensors")
    assert out.endswith("\x1b[K\n") and "(50%)" in out  # redrawn in place, then a newline
