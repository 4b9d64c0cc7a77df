"""Deadlines end to end: a request whose deadline passes is finished with
DEADLINE_EXCEEDED between two steps, whether it waits in the queue or is generating, and its KV
pages are free at once; the client's gRPC deadline and ``--request-timeout`` (HTTP, which has no
client deadline) both reach the scheduler."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from coordinator.serving.sampler import SamplingParams
from coordinator.serving.scheduler import DeadlineExceeded
from coordinator.serving.server import CoordinatorConfig
from expertmesh.demo import WEIGHTS_DIR
from expertmesh.v1 import generation_pb2, generation_pb2_grpc
from tests.serving_utils import ServerThread, one_thread  # noqa: F401  (fixture)
from tests.test_queue_limits import _hold, _metric, ckpt  # noqa: F401  (fixture)
from tests.test_serving_scheduler import Collect, make_scheduler


class Slow:
    """Wraps a dispatcher: every MoE layer takes ``delay`` seconds longer (a loaded cluster)."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def submit(self, layer, x, topk_ids, topk_weights):
        time.sleep(self.delay)
        return self.inner.submit(layer, x, topk_ids, topk_weights)


def test_a_queued_request_past_its_deadline_never_runs(ckpt):  # noqa: F811
    s, _ = make_scheduler(ckpt)
    try:
        release = _hold(s)
        late, ok = Collect(), Collect()
        s.submit([1, 2, 3], SamplingParams(max_new_tokens=4), late, deadline=time.monotonic() + 0.1)
        s.submit([1, 2, 3], SamplingParams(max_new_tokens=4), ok, deadline=time.monotonic() + 60)
        time.sleep(0.3)
        steps = s.stats()["steps"]
        release.set()
        toks, out = late.run()
        assert toks == [] and out.finish_reason == "error" and isinstance(out.error, DeadlineExceeded)
        assert "request queued, 0 of at most 4 tokens" in str(out.error)
        assert ok.run()[1].finish_reason == "length"
        st = s.stats()
        assert st["expired"] == 1 and st["queued"] == 0 and st["free_pages"] == st["total_pages"]
        assert st["steps"] - steps == 4  # the late one took no step of its own
    finally:
        s.stop()


def test_a_running_request_is_stopped_at_its_deadline_and_freed(ckpt):  # noqa: F811
    s, flaky = make_scheduler(ckpt)
    flaky.inner = Slow(flaky.inner, 0.02)  # 2 MoE layers: >= 40 ms a step
    try:
        c = Collect()
        t0 = time.monotonic()
        s.submit([1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True), c, deadline=t0 + 0.5)
        toks, out = c.run()
        took = time.monotonic() - t0
        assert isinstance(out.error, DeadlineExceeded) and "request running" in str(out.error)
        assert 0 < len(toks) < 100 and took < 0.5 + 1.0, (len(toks), took)
        st = s.stats()
        assert st["free_pages"] == st["total_pages"] and not st["running"]
    finally:
        s.stop()


@pytest.fixture(scope="module")
def coord():
    config = CoordinatorConfig(model_dir=str(WEIGHTS_DIR), port=0, http_port=0, request_timeout_s=0.5)
    with ServerThread(config) as s:
        yield s


def _pages_free(s: ServerThread, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = s.scheduler.stats()
        if st["free_pages"] == st["total_pages"] and not (st["running"] or st["waiting"] or st["queued"]):
            return True
        time.sleep(0.02)
    return False


def test_grpc_deadline_on_a_loaded_coordinator(coord):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(coord.addr))
    release = _hold(coord.scheduler)  # the coordinator is busy: requests queue
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generation_pb2.GenerateRequest(prompt="hello", max_new_tokens=8), timeout=0.3))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 2.0
    finally:
        release.set()
    assert _pages_free(coord)


def test_request_timeout_on_http_is_504_and_counted(coord):
    url = f"http://127.0.0.1:{coord.server.http.port}/v1/completions"
    model = httpx.get(url.replace("completions", "models"), timeout=10).json()["data"][0]["id"]
    before = _metric(coord, "deadline")
    release = _hold(coord.scheduler)
    threading.Timer(1.0, release.set).start()  # busy for longer than --request-timeout 0.5
    r = httpx.post(url, json={"model": model, "prompt": "hello", "max_tokens": 8}, timeout=30)
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["type"] == "timeout_error" and "deadline exceeded: request queued" in err["message"]
    assert _metric(coord, "deadline") - before == 1
    assert _pages_free(coord)
    # the gRPC client's longer deadline is capped by --request-timeout too
    release = _hold(coord.scheduler)
    threading.Timer(1.0, release.set).start()
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(coord.addr))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generation_pb2.GenerateRequest(prompt="hello", max_new_tokens=8), timeout=30))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "request queued" in e.value.details()
    # an unloaded coordinator answers well within the timeout
    r = httpx.post(url, json={"model": model, "prompt": "hello", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
