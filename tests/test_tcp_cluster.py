"""The TCP data path in whole clusters of real processes: greedy tokens and logits equal HF
transformers' for every architecture; kill -9 of a replica mid-load fails no request; TLS on
the data port with the gRPC port's certificate; the coordinator reaching the data port through
the latency proxy (``--server-data-address``)."""

from __future__ import annotations

import re
import socket
import time

import grpc
import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ExpertServerError, ServerSpec
from expertmesh.transport.delay_proxy import DelayProxy
from tests.cluster_utils import start_server
from tests.hf_models import ARCHS, make_checkpoint
from tests.test_cluster import check_cluster_matches_hf, engine_for
from tests.test_cluster import cluster as cluster  # noqa: F401  # NOTE: the fixture, per architecture
from tests.test_parity import assert_greedy_matches_hf
from tests.test_tcp_path import metric

pytestmark = pytest.mark.slow


def greedy_matches_hf(path, hf, cfg: ClusterConfig) -> list[dict]:
    """Prefill + greedy decode over ``cfg`` against HF; returns the server infos."""
    eng, d = engine_for(path, cfg)
    try:
        prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
        assert_greedy_matches_hf(eng, hf, prompt)
        return d.server_infos()
    finally:
        d.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_tcp_matches_hf_for_every_architecture(arch, tmp_path):
    hf = make_checkpoint(arch, tmp_path, original_format=arch != "qwen2_moe")
    srv = start_server("cpu", tmp_path)
    try:
        infos = greedy_matches_hf(
            tmp_path, hf, ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),), transport="tcp")
        )
        assert infos[0]["transport"] == "tcp", infos
    finally:
        srv.stop()


# one architecture over two servers is enough: every one runs over tcp above
@pytest.mark.parametrize("cluster", ["qwen3_moe"], indirect=True)
def test_tcp_split_over_two_servers_matches_hf(cluster):  # noqa: F811
    infos = check_cluster_matches_hf(cluster, "split", transport="tcp")
    assert [i["transport"] for i in infos] == ["tcp", "tcp"], infos


def test_auto_takes_tcp_where_shared_memory_is_off_and_required_tcp_says_why(tmp_path):
    hf = make_checkpoint("qwen3_moe", tmp_path)
    srv = start_server("cpu", tmp_path, 0, "--no-shm")
    no_tcp = start_server("cpu", tmp_path, 0, "--no-tcp")
    try:
        infos = greedy_matches_hf(tmp_path, hf, ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),)))
        assert infos[0]["transport"] == "tcp" and "--no-shm" in infos[0]["transport_note"], infos
        with pytest.raises(ExpertServerError) as ei:
            engine_for(tmp_path, ClusterConfig((ServerSpec("cpu0", no_tcp.address, "cpu"),), transport="tcp"))
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--transport tcp is impossible" in str(ei.value) and "--no-tcp" in str(ei.value)
    finally:
        srv.stop()
        no_tcp.stop()


def test_through_the_latency_proxy(tmp_path):
    hf = make_checkpoint("qwen3_moe", tmp_path)
    srv = start_server("cpu", tmp_path)
    data_port = int(srv.output().split("TCP data path on ")[1].split()[0].rsplit(":", 1)[1])
    try:
        with DelayProxy(("127.0.0.1", data_port), delay_us=200, jitter_us=50) as proxy:
            spec = ServerSpec("cpu0", srv.address, "cpu", data_address=proxy.address)
            infos = greedy_matches_hf(tmp_path, hf, ClusterConfig((spec,), transport="tcp"))
            assert infos[0]["transport"] == "tcp" and proxy.connections == 1
            # a data address where nothing listens: required tcp refuses, saying where it tried
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                closed = f"127.0.0.1:{s.getsockname()[1]}"
            bad = ServerSpec("cpu0", srv.address, "cpu", data_address=closed)
            with pytest.raises(ExpertServerError) as ei:
                engine_for(tmp_path, ClusterConfig((bad,), transport="tcp", timeout_s=5.0))
            assert closed in str(ei.value), ei.value
            # auto goes on over gRPC, saying why
            infos = greedy_matches_hf(tmp_path, hf, ClusterConfig((bad,), transport="auto"))
            assert infos[0]["transport"] in ("grpc", "shm"), infos
    finally:
        srv.stop()


def test_tls_on_the_data_path(tmp_path):
    from tests.tls_utils import CA  # NOTE: `cryptography` is a test dependency

    hf = make_checkpoint("qwen3_moe", tmp_path / "model")
    ca = CA.make(tmp_path, "good")
    expert, coord = ca.issue(tmp_path, "expert", client=False), ca.issue(tmp_path, "coordinator")
    srv = start_server(
        "cpu", tmp_path / "model", 0, "--tls-cert", str(expert.cert), "--tls-key", str(expert.key),
        "--tls-ca", str(expert.ca), "--metrics-port", "0",
    )  # fmt: skip
    try:
        line = srv.output().split("TCP data path on ")[1].split("\n")[0]
        assert line.endswith("(TLS)"), line
        data_port = int(line.split()[0].rsplit(":", 1)[1])
        infos = greedy_matches_hf(
            tmp_path / "model",
            hf,
            ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),), transport="tcp", tls=coord),
        )
        assert infos[0]["transport"] == "tcp", infos
        # the data port speaks TLS only: plaintext bytes get no answer, the connection is dropped
        with socket.create_connection(("127.0.0.1", data_port), timeout=10) as s:
            s.sendall(b"EMTCP1\0\0" + bytes(16))
            deadline = time.monotonic() + 10
            got = b""
            while time.monotonic() < deadline:
                try:
                    chunk = s.recv(4096)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                got += chunk
            assert b"EMTCPOK" not in got and time.monotonic() < deadline
        url = re.search(r"metrics on (http://\S+)", srv.output())
        assert url, srv.output()
        deadline = time.monotonic() + 10
        while metric(url.group(1), "expertmesh_worker_data_connections_dropped_total", reason="tls") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        srv.stop()


def test_auto_takes_tcp_when_the_server_has_another_dev_shm(tmp_path):
    """Containers on one host share the boot id but not /dev/shm: auto plans shared memory, the
    server cannot open the segment, and the coordinator replaces the stream by a tcp one."""
    import shutil
    import subprocess
    import sys

    from tests.cluster_utils import _LISTEN, ServerProc, spawn

    # NOTE: a machine that cannot run this fails it, saying why (util-linux's unshare and root,
    # as CI has): a skip here would hide the container case
    if shutil.which("unshare") is None:
        pytest.fail("needs unshare(1) (util-linux) to give a server its own /dev/shm")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.fail(f"cannot mount a private /dev/shm here (needs root): {probe.stderr.decode().strip()}")
    hf = make_checkpoint("qwen3_moe", tmp_path)
    inner = f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -m expertmesh.cli cpu-server --model {tmp_path} --port 0"
    proc, lines, m = spawn(["unshare", "-m", "sh", "-c", inner], _LISTEN, 60.0)
    srv = ServerProc("cpu", proc, int(m.group(2)), lines)
    try:
        infos = greedy_matches_hf(tmp_path, hf, ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),)))
        assert infos[0]["transport"] == "tcp", infos
        assert "cannot open the coordinator's shared-memory segment" in infos[0]["transport_note"], infos
    finally:
        srv.stop()
