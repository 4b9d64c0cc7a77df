"""The CLI end to end: ``expertmesh up`` (three processes) on a generated model, ``expertmesh
generate`` (JSON and streamed), then SIGTERM: no child process and no listening port remain.
Also: a child failing at start-up makes ``up`` exit non-zero with its output."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests.hf_models import make_checkpoint
from tests.serving_utils import write_word_tokenizer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "expertmesh.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout)


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def serving_processes(model: Path) -> list[int]:
    """Live processes whose command line names ``model`` (the children of an ``up``)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            d.name.isdigit()
            and str(model).encode() in cmd
            and b"expertmesh.cli" in cmd
            and not gone(int(d.name))
        ):
            out.append(int(d.name))
    return out


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_cli")
    make_checkpoint("qwen3_moe", path)
    write_word_tokenizer(path)
    return path


def start_up(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "expertmesh.cli", "up", *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=ENV,
        start_new_session=True,
    )


def server_ports(stderr) -> list[int]:
    """The expert servers' ports from ``up``'s banner on stderr, after the topology and loading
    lines that come first (``  gpu expert server 127.0.0.1:P, cpu expert server 127.0.0.1:Q``)."""
    for line in stderr:
        found = re.findall(r"expert server 127\.0\.0\.1:(\d+)", line)
        if found:
            return [int(p) for p in found]
    return []


def test_up_generate_and_clean_shutdown(model):
    up = start_up("--model", str(model), "--device", "cpu", "--threads", "1")
    try:
        assert up.stdout is not None and up.stderr is not None
        line = up.stdout.readline()  # blocks until serving (or exit)
        m = re.search(r"expertmesh is serving on (\S+):(\d+)", line)
        assert m, f"no address line: {line!r}; stderr:\n{up.stderr.read() if up.poll() is not None else ''}"
        addr, port = f"{m.group(1)}:{m.group(2)}", int(m.group(2))
        ports = [port, *server_ports(up.stderr)]
        assert len(ports) == 3
        kids = children_of(up.pid)
        assert len(kids) == 3

        r = cli(
            "generate",
            "--addr",
            addr,
            "--input-ids",
            "5,6,7",
            "--max-new-tokens",
            "6",
            "--json",
            "--logprobs",
        )
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert len(out["token_ids"]) == 6 and len(out["logprobs"]) == 6
        assert out["finish_reason"] == "length" and out["text"] == "".join(f" w{t}" for t in out["token_ids"])

        r = cli("generate", "--addr", addr, "--prompt", "w5 w6 w7", "--max-new-tokens", "6")
        assert r.returncode == 0 and r.stdout.strip() == out["text"].strip()
        assert "finish_reason=length" in r.stderr

        r = cli("generate", "--addr", addr, "--input-ids", "5,6", "--temperature", "-1")
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "temperature" in r.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        rc = up.wait(60)
    assert rc == 0
    deadline = time.monotonic() + 10
    while not all(gone(k) for k in kids) or any(listening(p) for p in ports):
        assert time.monotonic() < deadline, f"left behind: {[k for k in kids if not gone(k)]} {ports}"
        time.sleep(0.1)


def test_generate_reports_unreachable_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = cli("generate", "--addr", f"127.0.0.1:{port}", "--input-ids", "1", "--timeout", "5")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


def test_up_fails_cleanly_when_a_child_dies(model):
    # the expert servers start; the coordinator cannot read its placement file and exits
    missing = model / "no-such-placement.json"
    up = start_up("--model", str(model), "--device", "cpu", "--coordinator-args", f"--placement {missing}")
    out, err = up.communicate(timeout=120)
    assert up.returncode == 1, (out, err)
    assert "coordinator exited" in err and "serving" not in out
    assert serving_processes(model) == []


def test_up_refuses_more_gpu_experts_than_the_model_has(model):
    up = start_up("--model", str(model), "--device", "cpu", "--num-gpu-experts", "9")
    out, err = up.communicate(timeout=120)
    assert up.returncode == 2 and "--num-gpu-experts 9 outside [0, 8]" in err, (out, err)
    assert serving_processes(model) == []


def test_up_with_prompt_prints_one_completion_and_stops(model):
    up = start_up("--model", str(model), "--device", "cpu", "--prompt", "w5 w6 w7", "--max-new-tokens", "6")
    out, err = up.communicate(timeout=120)
    assert up.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("expertmesh is serving on ")
    words = lines[1].split()
    assert words[:3] == ["w5", "w6", "w7"] and len(words) == 9, lines
    assert serving_processes(model) == []


def test_up_passes_coordinator_flags_and_writes_each_childs_log(model, tmp_path):
    """The coordinator flags ``up`` takes reach the coordinator (LoRA roots, EPLB, a pass-through
    group), and each child's whole output is in the log directory the banner names."""
    (tmp_path / "adapters").mkdir()
    logs = tmp_path / "logs"
    up = start_up(
        "--model", str(model), "--device", "cpu", "--threads", "1", "--http-port", "-1",
        "--lora-dir", str(tmp_path / "adapters"), "--eplb-interval-steps", "50",
        "--coordinator-args", "--eplb-window-steps 7 --max-loras 2", "--log-dir", str(logs),
    )  # fmt: skip
    names: list[str] = []
    try:
        assert up.stdout is not None and up.stderr is not None
        line = up.stdout.readline()  # blocks until serving (or exit)
        m = re.search(r"expertmesh is serving on (\S+:\d+)", line)
        assert m, f"no address line: {line!r}; stderr:\n{up.stderr.read() if up.poll() is not None else ''}"
        addr = m.group(1)
        banner: list[str] = []
        while not any("logs in" in b for b in banner):
            banner.append(up.stderr.readline())
            assert len(banner) < 50 and banner[-1], banner
        where = banner[-1]
        assert f"logs in {logs}:" in where and "--verbose" in where, where
        names = re.findall(r"([a-z-]+)\.log", where)
        assert "coordinator" in names and len(names) >= 2, where  # the coordinator and its servers
        with grpc.insecure_channel(addr) as ch:
            st = admin_pb2_grpc.AdminStub(ch).GetEplbStatus(admin_pb2.GetEplbStatusRequest(), timeout=10)
        assert (st.interval_steps, st.window_steps) == (50, 7)
        r = cli("lora", "load", "x", str(tmp_path / "adapters" / "missing"), "--addr", addr)
        assert r.returncode != 0 and "not a directory" in r.stderr, r.stderr  # it is under --lora-dir
    finally:
        up.send_signal(signal.SIGTERM)
        rc = up.wait(60)
    assert rc == 0
    for name in names:
        assert "listening on" in (logs / f"{name}.log").read_text(), name
