"""The serving path across three processes: coordinator (in this process) + a GPU expert
server (on the CPU) + a CPU expert server, over loopback gRPC.

16 concurrent greedy requests equal HF transformers' greedy tokens and logprobs; admin reports
the servers and placement; a killed expert server fails only the requests under way (UNAVAILABLE,
pages freed), health drops to NOT_SERVING on gRPC and HTTP alike, and serving resumes when the
server comes back."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.serving.server import CoordinatorConfig
from expertmesh import health
from expertmesh.client import Client
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.serving_utils import (
    ServerThread,
    hf_greedy,
    one_thread,  # noqa: F401 (autouse fixture)
)
from tests.test_serving import OUT_LENS, PROMPTS, check_against_hf, run_concurrently, wait_idle

pytestmark = pytest.mark.slow


def wait_health(addr: str, want: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := health.check(addr, 1.0)) != want:
        assert time.monotonic() < deadline, f"health is {got}, waited for {want}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("qwen3_moe_cluster")
    make_checkpoint("qwen3_moe", path)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    refs = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, OUT_LENS)]
    gpu, cpu = start_server("gpu", path), start_server("cpu", path)
    servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
    config = CoordinatorConfig(
        model_dir=str(path),
        port=0,
        page_size=4,
        max_batch_tokens=32,
        max_running=16,
        connect_timeout_s=2.0,
        cluster=ClusterConfig(servers, num_gpu_experts=4, timeout_s=10.0),
        http_port=0,
    )
    try:
        with ServerThread(config) as s:
            wait_health(s.addr, "SERVING")
            yield path, refs, s, gpu, cpu
    finally:
        gpu.stop()
        cpu.stop()


def test_cluster_batching_matches_hf(cluster):
    _, refs, s, _, _ = cluster
    results = asyncio.run(run_concurrently(s.addr, logprobs=True))
    check_against_hf(results, refs)
    st = wait_idle(s)
    assert st["free_pages"] == st["total_pages"]


def test_cluster_admin(cluster):
    _, _, s, gpu, cpu = cluster
    with grpc.insecure_channel(s.addr) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        servers = admin.ListServers(admin_pb2.ListServersRequest()).servers
        placement = admin.GetPlacement(admin_pb2.GetPlacementRequest())
    assert [(x.name, x.address, x.kind, x.state) for x in servers] == [
        ("gpu0", gpu.address, "gpu", "ready"),
        ("cpu0", cpu.address, "cpu", "ready"),
    ]
    assert list(placement.servers) == ["gpu0", "cpu0"] and placement.generation >= 1
    for lp in placement.layers:
        assert sorted(lp.phy2log) == list(range(8))
        assert [o for e, o in sorted(zip(lp.phy2log, lp.owner))] == [0] * 4 + [1] * 4


def test_killed_expert_server_fails_requests_and_serving_resumes(cluster):
    path, refs, s, _, cpu = cluster
    port = cpu.port
    with Client(s.addr) as c:
        stream = c.stream(input_ids=PROMPTS[0], max_new_tokens=200, ignore_eos=True)
        next(stream)
        cpu.kill()
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert "cpu0" in e.value.details()
        st = wait_idle(s)
        assert st["free_pages"] == st["total_pages"]
        wait_health(s.addr, "NOT_SERVING")
        health_url = f"http://127.0.0.1:{s.server.http.port}/health"
        assert httpx.get(health_url, timeout=10).status_code == 503  # a load balancer's view
        with pytest.raises(grpc.RpcError) as e:
            c.generate(input_ids=[1, 2, 3], max_new_tokens=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        restarted = start_server("cpu", path, port)
        cluster[4].proc = restarted.proc  # the fixture stops whatever runs now
        wait_health(s.addr, "SERVING")
        assert httpx.get(health_url, timeout=10).status_code == 200
        out = c.generate(input_ids=PROMPTS[3], max_new_tokens=OUT_LENS[3], ignore_eos=True)
        assert out.token_ids == refs[3][0]
