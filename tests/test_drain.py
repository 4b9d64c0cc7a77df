"""Graceful drain on SIGTERM, on real processes over loopback.

Expert server: health NOT_SERVING and new streams refused with UNAVAILABLE "draining" at once,
layers on open streams answered until its drain timeout, then refused too; the coordinator sees
the health, routes around it (every expert is replicated: no request fails, no token changes),
re-places its experts on the rest and closes its stream, so the server exits 0 well before its
drain timeout. Coordinator: new requests refused (gRPC UNAVAILABLE, HTTP 503),
running requests finish, exit 0; past ``--drain-timeout`` the rest fail with UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import threading
import time

import grpc
import httpx
import pytest
import torch

from expertmesh import health, wire
from expertmesh.checkpoint import CheckpointReader
from expertmesh.client import Client
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.worker_api import ExpertRequest
from tests.cluster_utils import start_server
from tests.fault_utils import (
    Job,
    placement_file,
    run_load,
    server_states,
    start_coordinator,
    wait_health,
    wait_states,
)
from tests.hf_models import make_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = [tuple((5 * i + j * 7) % 90 + 2 for j in range(3 + i % 4)) for i in range(8)]
BOTH_READY = {"gpu0": "ready", "cpu0": "ready"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("drain")
    make_checkpoint("qwen3_moe", path)
    return path


def ok_tokens(results) -> list[list[list[int]]]:
    for c, outs in enumerate(results):
        for r, o in enumerate(outs):
            assert o.error is None, f"client {c} request {r}: {o.error}"
    return [[o.tokens for o in outs] for outs in results]


def consume(call) -> None:
    with contextlib.suppress(grpc.RpcError):  # it ends UNAVAILABLE (draining): checked below
        list(call)


def layer_request(model) -> pb.ForwardRequest:
    """A well-formed layer request (a draining server refuses it for draining, not its form)."""
    cfg = CheckpointReader(model).config
    x = torch.randn(1, cfg.hidden_size)
    slots = torch.zeros(1, cfg.top_k, dtype=torch.int32)
    req = ExpertRequest(1, 1, cfg.moe_layer_ids[0], x, slots, torch.ones(1, cfg.top_k), None, torch.arange(1))
    return wire.encode_request(req, torch.float32)


def test_sigterm_on_an_expert_server_drains_it_without_failing_requests(model):
    every = list(range(8))
    p = placement_file(model / "both.json", {"*": {"gpu0": every, "cpu0": every}}, ["gpu0", "cpu0"])
    gpu = start_server("gpu", model, 0, "--drain-timeout", "30")
    cpu = start_server("cpu", model, 0, "--drain-timeout", "30")
    co = start_coordinator(
        model, "--gpu-server", gpu.address, "--cpu-server", cpu.address, "--placement", p,
        "--replica-policy", "round_robin", "--expert-timeout", "5", "--kv-memory", "8MiB",
    )  # fmt: skip
    jobs = [[Job(q, 8), Job(q, 8)] for q in PROMPTS]
    try:
        wait_health(co.addr, "SERVING")
        want = ok_tokens(run_load(co.addr, jobs))
        sent: list[float] = []

        def sigterm() -> None:
            sent.append(time.monotonic())
            cpu.proc.send_signal(signal.SIGTERM)

        got = run_load(co.addr, jobs, at_chunks=20, action=sigterm)
        assert ok_tokens(got) == want
        assert cpu.proc.wait(20) == 0, cpu.output()
        took = time.monotonic() - sent[0]
        assert "drained: no coordinator stream left" in cpu.output(), cpu.output()
        assert took < 15, took  # the coordinator moved off: no wait for the 30 s drain timeout
        assert server_states(co.addr)["cpu0"] == "unavailable"
        assert ok_tokens(run_load(co.addr, jobs)) == want  # on gpu0 alone

        # restarted: rejoins; then drained while a stream of another client stays open
        cpu = start_server("cpu", model, cpu.port, "--drain-timeout", "3")
        wait_states(co.addr, BOTH_READY, timeout=30)
        held: queue.Queue = queue.Queue()
        with grpc.insecure_channel(cpu.address) as ch:
            stub = pb_grpc.ExpertWorkerStub(ch)
            call = stub.Forward(iter(held.get, None))
            threading.Thread(target=consume, args=(call,), daemon=True).start()
            time.sleep(0.5)  # the server counts the stream once its handler runs
            cpu.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            wait_health(cpu.address, "NOT_SERVING", timeout=5)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Forward(iter([layer_request(model)]), timeout=5))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert "draining" in e.value.details()
            # past its drain timeout (3 s), a layer on the stream still open is refused too
            time.sleep(max(0.0, t0 + 4.0 - time.monotonic()))
            held.put(layer_request(model))
            time.sleep(0.5)
            assert call.done() and call.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in call.details()
            assert cpu.proc.wait(15) == 0, cpu.output()
        wait_states(co.addr, {"gpu0": "ready", "cpu0": "unavailable"}, timeout=10)
        assert ok_tokens(run_load(co.addr, jobs)) == want
    finally:
        co.stop()
        gpu.stop(40)
        cpu.stop(40)


def test_sigterm_on_the_coordinator_finishes_running_requests_and_refuses_new_ones(model):
    co = start_coordinator(model, "--kv-memory", "8MiB", "--http-port", "0", "--drain-timeout", "60")
    jobs = [[Job(q, 60)] for q in PROMPTS]
    try:
        deadline = time.monotonic() + 20  # printed just after the gRPC line
        while not (http := re.search(r"on http://(\S+):(\d+)", co.output())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http, co.output()
        url = f"http://127.0.0.1:{http.group(2)}/v1/completions"
        wait_health(co.addr, "SERVING")
        want = ok_tokens(run_load(co.addr, jobs))
        refused: list = []

        def sigterm() -> None:
            co.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while health.check(co.addr, 1.0) == "SERVING":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with Client(co.addr) as c:
                try:
                    c.generate(input_ids=[1, 2, 3], max_new_tokens=2)
                except grpc.RpcError as e:
                    refused.append((e.code(), e.details()))
            refused.append(
                httpx.post(url, json={"model": "x", "prompt": [1, 2], "max_tokens": 2}).status_code
            )

        got = run_load(co.addr, jobs, at_chunks=16, action=sigterm)
        assert ok_tokens(got) == want  # the running requests finished
        assert refused[0][0] == grpc.StatusCode.UNAVAILABLE and "draining" in refused[0][1], refused
        assert refused[1] == 503, refused
        assert co.proc.wait(30) == 0, co.output()
    finally:
        co.stop()

    # past the drain timeout the rest are cancelled with a clear status; exit 0 all the same
    co = start_coordinator(model, "--kv-memory", "8MiB", "--drain-timeout", "0.3")
    try:
        wait_health(co.addr, "SERVING")
        long = [[Job(q, 200)] for q in PROMPTS]
        got = run_load(co.addr, long, at_chunks=16, action=lambda: co.proc.send_signal(signal.SIGTERM))
        errs = [o.error for [o] in got if o.error is not None]
        assert errs, "every request finished within 0.3 s: the test proves nothing"
        for code, msg in errs:
            assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in msg, (code, msg)
        assert co.proc.wait(30) == 0, co.output()
    finally:
        co.stop()
