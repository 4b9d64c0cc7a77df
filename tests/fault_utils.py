"""Helpers for the fault tests (tests/test_fault_tolerance.py, test_drain.py, test_degraded.py):
a coordinator as a real subprocess (so that it can be signalled and its /proc entries
counted), a load of concurrent streaming clients, and resource snapshots. (No tests here.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from expertmesh import health
from expertmesh.client import AsyncClient
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests.cluster_utils import ROOT, spawn

_LISTEN = re.compile(r"coordinator listening on (\S+):(\d+)")


@dataclass
class CoordProc:
    proc: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)  # its output, read by a thread

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_coordinator(model: str | Path, *flags: str, timeout: float = 90.0) -> CoordProc:
    cmd = [sys.executable, "-m", "expertmesh.cli", "coordinator", "--model", str(model), "--port", "0"]
    proc, lines, m = spawn([*cmd, "--threads", "1", *flags], _LISTEN, timeout)
    return CoordProc(proc, int(m.group(2)), lines)


def wait_health(addr: str, want: str, timeout: float = 60.0) -> float:
    """Waits until health reports ``want``; returns the seconds it took."""
    t0 = time.monotonic()
    while (got := health.check(addr, 1.0)) != want:
        assert time.monotonic() - t0 < timeout, f"health is {got}, waited {timeout}s for {want}"
        time.sleep(0.05)
    return time.monotonic() - t0


def server_states(addr: str) -> dict[str, str]:
    with grpc.insecure_channel(addr) as ch:
        resp = admin_pb2_grpc.AdminStub(ch).ListServers(admin_pb2.ListServersRequest(), timeout=10)
    return {s.name: s.state for s in resp.servers}


def wait_states(addr: str, want: dict[str, str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := server_states(addr)) != want:
        assert time.monotonic() < deadline, f"servers {got}, waited for {want}"
        time.sleep(0.1)


def load_lora(addr: str, name: str, path: Path) -> None:
    with grpc.insecure_channel(addr) as ch:
        admin_pb2_grpc.AdminStub(ch).LoadLoRA(
            admin_pb2.LoadLoRARequest(name=name, path=str(path)), timeout=60
        )


def unload_lora(addr: str, name: str) -> None:
    with grpc.insecure_channel(addr) as ch:
        admin_pb2_grpc.AdminStub(ch).UnloadLoRA(admin_pb2.UnloadLoRARequest(name=name), timeout=60)


def placement_file(path: Path, layers: dict[str, dict[str, list[int]]], servers: list[str]) -> str:
    path.write_text(json.dumps({"servers": servers, "layers": layers}))
    return str(path)


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    new_tokens: int
    lora: str = ""


@dataclass
class Outcome:
    tokens: list[int]
    error: tuple[grpc.StatusCode, str] | None = None
    seconds: float = 0.0


async def _run_client(
    addr: str, jobs: list[Job], on_chunk: Callable[[], None], timeout: float
) -> list[Outcome]:
    out = []
    async with AsyncClient(addr, timeout=timeout) as c:
        for job in jobs:
            toks: list[int] = []
            t0 = time.monotonic()
            try:
                async for chunk in c.stream(
                    input_ids=list(job.prompt), max_new_tokens=job.new_tokens, ignore_eos=True, lora=job.lora
                ):
                    toks += chunk.token_ids
                    on_chunk()
                out.append(Outcome(toks, seconds=time.monotonic() - t0))
            except grpc.RpcError as e:  # the client's typed errors (expertmesh.errors) are RpcErrors
                out.append(Outcome(toks, (e.code(), e.details() or ""), time.monotonic() - t0))
    return out


def run_load(
    addr: str,
    clients: list[list[Job]],
    at_chunks: int | None = None,
    action: Callable[[], None] | None = None,
    timeout: float = 120.0,
) -> list[list[Outcome]]:
    """Runs each client's jobs in turn, all clients concurrently, streaming; ``action`` runs
    once (on the event loop) when ``at_chunks`` chunks have arrived in total."""
    seen = [0]
    fired = [action is None]

    def on_chunk() -> None:
        seen[0] += 1
        if not fired[0] and at_chunks is not None and seen[0] >= at_chunks:
            fired[0] = True
            assert action is not None
            action()

    async def main() -> list[list[Outcome]]:
        return list(await asyncio.gather(*(_run_client(addr, jobs, on_chunk, timeout) for jobs in clients)))

    results = asyncio.run(main())
    assert fired[0], f"the load ended before {at_chunks} chunks ({seen[0]})"
    return results


def proc_resources(pid: int) -> dict[str, int]:
    """Open fds, threads and resident KiB of process ``pid`` (Linux /proc)."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    rss = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    return {"fds": fds, "threads": threads, "rss_kib": rss}


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


@dataclass
class ZygoteServer:
    """An expert server forked by :class:`Zygote` (a real process; its exit status is not kept)."""

    kind: str
    pid: int
    port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _signal(self, sig: int, timeout: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
            time.sleep(0.01)

    def kill(self) -> None:
        self._signal(signal.SIGKILL, 10)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, 40)


class Zygote:
    """tests/server_zygote.py: expert servers for a fork each (the kill/restart cycles)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.server_zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self._n = 0
        self.pids: list[int] = []  # every server it forked (killed by close, whatever is left)

    def start(
        self, kind: str, model: str | Path, port: int = 0, *extra: str, timeout: float = 60
    ) -> ZygoteServer:
        argv = [f"{kind}-server", "--model", str(model), "--port", str(port), *extra]
        if kind == "gpu":
            argv += ["--device", "cpu"]
        self._n += 1
        log = self.workdir / f"{kind}-{self._n}.log"
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        self.pids.append(pid)
        deadline = time.monotonic() + timeout
        pattern = re.compile(r"listening on (\S+):(\d+)")
        while time.monotonic() < deadline:
            m = pattern.search(log.read_text()) if log.exists() else None
            if m:
                return ZygoteServer(kind, pid, int(m.group(2)), log)
            time.sleep(0.02)
        raise RuntimeError(f"{kind}-server did not start:\n{log.read_text() if log.exists() else ''}")

    def close(self) -> None:
        for pid in self.pids:  # NOTE: a failed test may leave some running
            try:  # only a fork of this zygote (a dead one's pid may be someone else's by now)
                if "server_zygote" in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)
