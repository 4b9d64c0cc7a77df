"""The two health names an orchestrator probes (deploy/k8s): ``""`` is SERVING only while the
process can serve, ``liveness`` while it answers at all. A coordinator whose expert server is
down, and an expert server still loading or draining, are not ready but alive (a liveness probe on
``""`` would restart them for a state they leave by themselves)."""

from __future__ import annotations

import queue
import signal
import socket
import time

import grpc
import pytest

from expertmesh import health
from expertmesh.health import LIVENESS
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from tests.cluster_utils import start_server
from tests.fault_utils import start_coordinator, wait_health
from tests.hf_models import make_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("liveness")
    make_checkpoint("qwen3_moe", path)
    return path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_a_coordinator_without_its_expert_server_is_alive_but_not_ready(model):
    co = start_coordinator(
        model, "--cpu-server", f"127.0.0.1:{_closed_port()}", "--kv-memory", "8MiB", "--connect-timeout", "1"
    )
    try:
        assert health.check(co.addr, 3.0, LIVENESS) == "SERVING"
        assert health.check(co.addr, 3.0) == "NOT_SERVING"
        assert health.check(co.addr, 3.0, "no-such-name") == "UNREACHABLE"  # NOT_FOUND: names are not guessed
    finally:
        co.stop()
    assert co.proc.returncode == 0, co.output()


def test_an_expert_server_stays_alive_while_it_drains(model):
    srv = start_server("cpu", model, 0, "--drain-timeout", "30")
    try:
        wait_health(srv.address, "SERVING", timeout=30)
        assert health.check(srv.address, 3.0, LIVENESS) == "SERVING"
        held: queue.Queue = queue.Queue()
        with grpc.insecure_channel(srv.address) as ch:
            # an open stream keeps it draining (with none it would exit at once)
            call = pb_grpc.ExpertWorkerStub(ch).Forward(iter(held.get, None))
            time.sleep(0.5)  # the server counts the stream once its handler runs
            srv.proc.send_signal(signal.SIGTERM)
            wait_health(srv.address, "NOT_SERVING", timeout=5)
            assert health.check(srv.address, 3.0, LIVENESS) == "SERVING"
            assert srv.proc.poll() is None
            held.put(None)
            call.cancel()
        assert srv.proc.wait(15) == 0, srv.output()
    finally:
        srv.stop(10)
