"""Start expert servers as real subprocesses on free loopback ports, for multi-process tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class ServerProc:
    kind: str
    proc: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)  # its output so far, read by a thread

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s (a draining server may need longer)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def start_server(
    kind: str, model: str | Path, port: int = 0, *extra: str, timeout: float = 60.0
) -> ServerProc:
    cmd = [
        sys.executable,
        "-m",
        "expertmesh.cli",
        f"{kind}-server",
        "--model",
        str(model),
        "--port",
        str(port),
        *extra,
    ]
    if kind == "gpu" and "--device" not in extra:
        cmd += ["--device", "cpu"]
    proc, lines, m = spawn(cmd, _LISTEN, timeout)
    return ServerProc(kind, proc, int(m.group(2)), lines)


def spawn(
    cmd: list[str], pattern: re.Pattern, timeout: float
) -> tuple[subprocess.Popen, list[str], re.Match]:
    """Starts ``cmd`` and waits for a line matching ``pattern``; a thread keeps reading its
    output into the returned list (a full pipe would block the process)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = pattern.search(line)
        if m:
            threading.Thread(target=_drain, args=(proc.stdout, lines), daemon=True).start()
            return proc, lines, m
    proc.kill()
    raise RuntimeError(f"{cmd[3]} did not start:\n" + "".join(lines))


def _drain(pipe, lines: list[str]) -> None:
    lines.extend(iter(pipe.readline, ""))
