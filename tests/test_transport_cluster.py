"""Fast paths across real processes: the same answers over every data path, no segment left in
/dev/shm after a kill -9 of either side, corrupted descriptors refused with INVALID_ARGUMENT,
and a server that refuses fast paths (--no-shm)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ExpertServerError, ServerSpec
from coordinator.model.engine import Engine
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import segment
from expertmesh.transport.errors import Rejected
from expertmesh.v1 import expert_worker_pb2 as pb
from tests.cluster_utils import ROOT, start_server
from tests.hf_models import make_checkpoint
from tests.test_cluster import check_cluster_matches_hf, engine_for, placements
from tests.test_cluster_faults import run_steps
from tests.test_parity import rel_err

pytestmark = pytest.mark.slow
PROMPT = list(range(5, 15))
TINY_RING_MB = 4096 / (1 << 20)  # the 10-token prefill does not fit: it goes over gRPC


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf = make_checkpoint("qwen3_moe", path)
    gpu = start_server("gpu", path)
    cpu = start_server("cpu", path)
    yield "qwen3_moe", path, hf, gpu, cpu
    gpu.stop()
    cpu.stop()


def our_entries(*pids: int) -> list[str]:
    """Entries in /dev/shm created by these processes (other test runs may share the host)."""
    return [n for n in segment.ours() if int(n.split("-")[1]) in pids]


def mapped_segments(pid: int) -> list[str]:
    """Our segments still mapped by ``pid`` (unlinked ones show as '(deleted)')."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if segment.PREFIX in line]


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------- parity


@pytest.mark.parametrize("which", ["split", "prefill_threshold"])
def test_shm_matches_hf(cluster, which):
    infos = check_cluster_matches_hf(cluster, which, transport="shm")
    assert [i["transport"] for i in infos] == ["shm", "shm"], infos


def test_every_path_gives_identical_results(cluster):
    _, path, _, gpu, cpu = cluster
    ne = 8
    runs = {}
    for transport, ring_mb in [("grpc", 64.0), ("shm", 64.0), ("shm", TINY_RING_MB), ("auto", 64.0)]:
        cfg = placements(gpu, cpu, path, ne, transport=transport, shm_ring_mb=ring_mb)["split"]
        eng, d = engine_for(path, cfg)
        try:
            runs[transport, ring_mb] = torch.stack(run_steps(eng, PROMPT, 4))
            infos = d.server_infos()
        finally:
            d.close()
        want = "grpc" if transport == "grpc" else "shm"
        assert [i["transport"] for i in infos] == [want, want], infos
        fallbacks = sum(i["fast_fallbacks"] for i in infos)
        assert (fallbacks > 0) == (ring_mb == TINY_RING_MB), infos
    first = runs["grpc", 64.0]
    for key, logits in runs.items():
        assert torch.equal(logits, first), key
    assert our_entries(os.getpid(), gpu.proc.pid, cpu.proc.pid) == []
    assert mapped_segments(os.getpid()) == []  # the coordinator's channels were unmapped


# ---------------------------------------------------------------------- bad input


def _bad_descriptors(ring: int) -> dict[str, tuple[bytes, str]]:
    good = dsc.Request(1, 0, 0, 1, 64, 2, torch.float32, torch.float32, 0, 256, 512)
    raw = good.pack()
    return {
        "corrupted": (raw[:50] + bytes([raw[50] ^ 0xFF]) + raw[51:], "checksum mismatch"),
        "truncated": (raw[:17], "truncated descriptor: 17 bytes"),
        "out_of_bounds": (
            dsc.Request(1, 0, 0, 1, 64, 2, torch.float32, torch.float32, ring, 256, 512).pack(),
            "outside",
        ),
        "garbage": (os.urandom(dsc.SIZE), "bad descriptor magic"),
    }


def test_corrupted_descriptors_are_rejected_and_serving_goes_on(cluster):
    _, path, _, gpu, cpu = cluster
    eng, d = engine_for(path, placements(gpu, cpu, path, 8, transport="shm")["split"])
    ref = Engine.from_checkpoint(str(path))
    want = torch.stack(run_steps(ref, PROMPT, 3))
    conn = d.conns[1]
    errors_before = conn.stub.Stats(pb.StatsRequest()).errors
    try:
        for case, (raw, words) in _bad_descriptors(d.cluster.shm_ring_bytes).items():
            fast = conn.open_stream().fast
            assert fast is not None
            os.write(fast._req_fd, raw)
            with pytest.raises(Rejected) as ei:
                fast.wait(1, time.monotonic() + 10)
            assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT, case
            assert words in ei.value.message, (case, ei.value.message)
            # the channel is gone; the next step opens a new one and gets right answers
            got = torch.stack(run_steps(eng, PROMPT, 3))
            assert rel_err(got, want) < 1e-4, case
            assert d.server_infos()[1]["transport"] == "shm"
        assert conn.stub.Stats(pb.StatsRequest()).errors - errors_before == 4
        # a bad request over the fast path fails the step with INVALID_ARGUMENT, like gRPC
        d.begin_step(1)
        x = torch.zeros(1, 64)
        ids = torch.zeros(1, 2, dtype=torch.long)
        w = torch.tensor([[float("nan"), 0.5]])
        with pytest.raises(ExpertServerError) as e2:
            d.submit(0, x, ids, w).wait()
        assert e2.value.code == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in str(e2.value)
        assert d.ready()
        assert rel_err(torch.stack(run_steps(eng, PROMPT, 3)), want) < 1e-4
    finally:
        d.close()


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"EMHS1{not json", "not valid JSON"),
        (b"EMHS1" + b'{"transport": "shm", "segment": "../../etc/shadow"}', "malformed"),
        (b"\x00" * 40, "does not start with"),
    ],
)
def test_corrupted_handshake_is_invalid_argument(cluster, raw, words):
    _, _, _, _, cpu = cluster
    from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc

    with grpc.insecure_channel(cpu.address) as ch:
        stub = pb_grpc.ExpertWorkerStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Forward(iter([pb.ForwardRequest(seq=0, fast_path=raw)]), timeout=10))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (ei.value.details() or "")
        # a segment that does not exist here: refused politely, the stream stays plain gRPC
        hello = f'EMHS1{{"transport": "shm", "segment": "expertmesh-1-1-{"0" * 16}", "size": 8192, "ring_offset": 4096, "ring_bytes": 4096, "token": "{"0" * 32}"}}'
        (resp,) = list(stub.Forward(iter([pb.ForwardRequest(seq=0, fast_path=hello.encode())]), timeout=10))
        assert b'"transport": "grpc"' in resp.fast_path and b"cannot open" in resp.fast_path


def test_a_lost_fast_path_is_a_warning(cluster, monkeypatch, caplog):
    """A shared-memory channel that cannot be created (a container's small /dev/shm) falls back
    to gRPC with a WARNING naming the cause: the user expected the fast path."""
    import errno
    import logging

    from coordinator.experts import expert_conn

    _, path, _, gpu, cpu = cluster

    def full(*_a, **_kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(expert_conn, "ShmClient", full)
    monkeypatch.setattr(expert_conn, "TcpClient", full)  # auto's next try after shared memory
    servers = (ServerSpec("cpu0", cpu.address, "cpu"),)
    with caplog.at_level(logging.INFO, "coordinator.experts.expert_conn"):
        _, d = engine_for(path, ClusterConfig(servers, transport="auto"))
    try:
        assert d.server_infos()[0]["transport"] == "grpc"
        lost = [r for r in caplog.records if "fast path is lost" in r.getMessage()]
        assert lost and all(r.levelno == logging.WARNING for r in lost), [
            r.getMessage() for r in caplog.records
        ]
        assert "No space left on device" in lost[-1].getMessage()
    finally:
        d.close()


def test_server_with_no_shm(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    # NOTE: --no-tcp too: auto takes the TCP data path where shared memory is off
    srv = start_server("cpu", tmp_path, 0, "--no-shm", "--no-tcp")
    try:
        servers = (ServerSpec("cpu0", srv.address, "cpu"),)
        eng, d = engine_for(tmp_path, ClusterConfig(servers, transport="auto"))
        assert d.server_infos()[0]["transport"] == "grpc"
        assert "--no-shm" in d.server_infos()[0]["transport_note"]
        d.close()
        with pytest.raises(ExpertServerError) as ei:
            engine_for(tmp_path, ClusterConfig(servers, transport="shm"))
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--transport shm is impossible" in str(ei.value) and "--no-shm" in str(ei.value)
    finally:
        srv.stop()


# ---------------------------------------------------------------------- crashes and leaks

COORDINATOR = """
import sys, torch
from coordinator.experts.remote import ClusterConfig, RemoteDispatcher, ServerSpec
from expertmesh.checkpoint import CheckpointReader
cfg = CheckpointReader(sys.argv[1]).config
d = RemoteDispatcher(cfg, ClusterConfig((ServerSpec("cpu0", sys.argv[2], "cpu"),), transport="shm"), torch.float32)
d.connect(30)
d.begin_step(3)
d.submit(0, torch.randn(3, cfg.hidden_size), torch.zeros(3, cfg.top_k, dtype=torch.long), torch.ones(3, cfg.top_k)).wait()
print("served", d.server_infos()[0]["transport"], flush=True)
sys.stdin.read()
"""


def _dead_pid() -> int:
    p = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(p.stdout)


def test_kill_9_either_side_leaves_nothing_and_serving_resumes(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    want = torch.stack(run_steps(Engine.from_checkpoint(str(tmp_path)), PROMPT, 3))
    srv = start_server("cpu", tmp_path)
    servers = (ServerSpec("cpu0", srv.address, "cpu"),)
    try:
        # 1. a coordinator (its own process) on the fast path, killed with SIGKILL
        coord = subprocess.Popen(
            [sys.executable, "-c", COORDINATOR, str(tmp_path), srv.address],
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert coord.stdout is not None
        assert coord.stdout.readline().split() == ["served", "shm"]
        assert mapped_segments(srv.proc.pid)  # the server maps the channel now...
        assert our_entries(coord.pid, srv.proc.pid) == []  # ...but no name is left in /dev/shm
        coord.send_signal(signal.SIGKILL)
        coord.wait(10)
        assert our_entries(coord.pid, srv.proc.pid) == []
        assert wait_until(lambda: not mapped_segments(srv.proc.pid)), mapped_segments(srv.proc.pid)

        # 2. the server goes on serving a new coordinator over shm
        eng, d = engine_for(tmp_path, ClusterConfig(servers, transport="shm", timeout_s=5.0))
        assert rel_err(torch.stack(run_steps(eng, PROMPT, 3)), want) < 1e-4
        assert d.server_infos()[0]["transport"] == "shm"

        # 3. the server killed with SIGKILL: the step fails fast, nothing is left behind
        port = srv.port
        srv.kill()
        with pytest.raises(ExpertServerError) as ei:
            run_steps(eng, PROMPT, 3)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE, ei.value
        assert our_entries(os.getpid(), srv.proc.pid) == []

        # a coordinator that died inside a handshake would leave names behind: the restarted
        # server's janitor removes them (creator gone)
        dead = _dead_pid()
        leftover = [f"expertmesh-{dead}-1-{'e' * 16}{s}" for s in ("", ".req", ".resp")]
        for name in leftover:
            (segment.SHM_DIR / name).write_bytes(b"")
            os.utime(segment.SHM_DIR / name, (time.time() - 60,) * 2)

        # 4. restarted on the same port: the coordinator reconnects over shm and serves again
        srv = start_server("cpu", tmp_path, port)
        assert all(not (segment.SHM_DIR / n).exists() for n in leftover)
        deadline = time.monotonic() + 30
        while True:
            try:
                got = torch.stack(run_steps(eng, PROMPT, 3))
                break
            except ExpertServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert rel_err(got, want) < 1e-4
        assert d.server_infos()[0]["transport"] == "shm" and d.ready()
        assert our_entries(os.getpid(), srv.proc.pid) == []
        d.close()
        assert mapped_segments(os.getpid()) == []
        assert wait_until(lambda: not mapped_segments(srv.proc.pid)), mapped_segments(srv.proc.pid)
    finally:
        srv.stop()
