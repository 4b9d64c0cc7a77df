"""Bounded admission queue: beyond ``--max-queued-requests`` / ``--max-queued-tokens``
a request is refused at once with RESOURCE_EXHAUSTED (gRPC) or 429 with OpenAI's error body
(HTTP, read through the openai client), counted as "rejected"; what was admitted still runs."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import openai
import pytest

from coordinator.serving.sampler import SamplingParams
from coordinator.serving.scheduler import QueueFull
from coordinator.serving.server import CoordinatorConfig
from expertmesh.demo import WEIGHTS_DIR
from expertmesh.v1 import generation_pb2, generation_pb2_grpc
from tests.serving_utils import ServerThread, one_thread  # noqa: F401  (fixture)
from tests.test_serving_scheduler import Collect, make_scheduler


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.hf_models import make_checkpoint

    path = tmp_path_factory.mktemp("qwen3_moe_queue")
    make_checkpoint("qwen3_moe", path, seed=1)
    return path


def _hold(scheduler) -> threading.Event:
    """Parks the scheduler thread between two steps until the event is set: what is submitted
    meanwhile stays queued."""
    release, parked = threading.Event(), threading.Event()
    scheduler.call_between_steps(lambda: (parked.set(), release.wait(60)))
    assert parked.wait(30)
    return release


def test_scheduler_refuses_beyond_the_queue_limits(ckpt):
    from coordinator.serving.scheduler import SchedulerLimits

    s, _ = make_scheduler(ckpt)
    s.limits = SchedulerLimits(max_batch_tokens=16, max_running=8, max_context=128, max_queued=2,
                               max_queued_tokens=10)  # fmt: skip
    try:
        release = _hold(s)
        a, b = Collect(), Collect()
        s.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=2), a)
        s.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=2), b)
        with pytest.raises(QueueFull, match="2 requests .8 prompt tokens"):
            s.submit([5], SamplingParams(max_new_tokens=2), Collect())
        assert s.stats()["queued"] == 2 and s.stats()["rejected"] == 1
        release.set()
        assert a.run()[1].finish_reason == "length" and b.run()[1].finish_reason == "length"
        assert s.stats()["queued"] == 0
        # tokens: 8 queued + 3 > 10 is refused; an empty queue takes a prompt above the token cap
        release = _hold(s)
        s.submit([1] * 8, SamplingParams(max_new_tokens=1), Collect())
        with pytest.raises(QueueFull, match="--max-queued-tokens 10"):
            s.submit([1] * 3, SamplingParams(max_new_tokens=1), Collect())
        release.set()
        deadline = time.monotonic() + 30
        while s.stats()["queued"] and time.monotonic() < deadline:
            time.sleep(0.01)
        big = Collect()
        s.submit([1] * 20, SamplingParams(max_new_tokens=1), big)
        assert big.run()[1].finish_reason == "length"
        assert s.stats()["free_pages"] == s.stats()["total_pages"]
    finally:
        s.stop()


@pytest.fixture(scope="module")
def coord():
    config = CoordinatorConfig(model_dir=str(WEIGHTS_DIR), port=0, http_port=0, max_queued_requests=1)
    with ServerThread(config) as s:
        yield s


def _metric(s: ServerThread, status: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{s.server.http.port}/metrics", timeout=10).text
    line = next(
        x for x in text.splitlines() if x.startswith(f'expertmesh_requests_total{{status="{status}"}}')
    )
    return float(line.split()[-1])


def _gauge(s: ServerThread, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{s.server.http.port}/metrics", timeout=10).text
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[-1])


def test_grpc_and_http_refuse_a_full_queue(coord):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(coord.addr))
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{coord.server.http.port}/v1", api_key="x", max_retries=0)
    model = oa.models.list().data[0].id
    rejected0 = _metric(coord, "rejected")
    release = _hold(coord.scheduler)
    try:
        first = stub.Generate(generation_pb2.GenerateRequest(prompt="hello", max_new_tokens=3), timeout=60)
        deadline = time.monotonic() + 30
        while coord.scheduler.stats()["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generation_pb2.GenerateRequest(prompt="hi", max_new_tokens=3), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-requests 1" in e.value.details()
        assert _gauge(coord, "expertmesh_requests_queued") == 1
        with pytest.raises(openai.RateLimitError) as h:
            oa.completions.create(model=model, prompt="hi", max_tokens=3)
        err = h.value.body
        assert h.value.status_code == 429 and err["type"] == "rate_limit_error", err
        assert err["code"] == "rate_limit_exceeded" and "retry later" in err["message"]
    finally:
        release.set()
    chunks = list(first)
    assert chunks[-1].finish_reason == generation_pb2.LENGTH and sum(len(c.token_ids) for c in chunks) == 3
    assert _metric(coord, "rejected") - rejected0 == 2
    # the queue drained: the same request now succeeds on both APIs
    assert list(stub.Generate(generation_pb2.GenerateRequest(prompt="hi", max_new_tokens=3), timeout=60))
    assert oa.completions.create(model=model, prompt="hi", max_tokens=3).choices[0].finish_reason == "length"
