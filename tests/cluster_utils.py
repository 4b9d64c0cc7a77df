"""Start expert servers as real subprocesses on free loopback ports, for multi-process tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class ServerProc:
    kind: str
    proc: subprocess.Popen
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
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
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
    )
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = _LISTEN.search(line)
        if m:
            # NOTE: keep draining the pipe so the server never blocks on a full stdout
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return ServerProc(kind, proc, int(m.group(2)))
    proc.kill()
    raise RuntimeError(f"{kind}-server did not start:\n{''.join(lines)}")
