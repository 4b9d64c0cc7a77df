"""Fuzz: seeded, randomly mutated ``GenerateRequest``s to a coordinator and
``ForwardRequest``s straight to the expert server it uses (fields, sizes, dtypes, shapes,
NaN/Inf, byte lengths, generations, slot ids, and raw protobuf bytes). Every answer is OK or a
clear status (never UNKNOWN or INTERNAL), every refused Forward is counted in the server's
error stats, no process dies, and afterwards a greedy request returns the tokens it returned
before. Bounded by a count and a time budget each (CI: ~20 s on a quiet 2-core machine)."""

from __future__ import annotations

import json
import math
import random
import time

import grpc
import httpx
import pytest
import torch

from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from coordinator.serving.server import CoordinatorConfig
from expertmesh import health, wire
from expertmesh.demo import WEIGHTS_DIR
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.v1 import generation_pb2, generation_pb2_grpc
from expertmesh.v1 import tensor_pb2 as tpb
from tests.cluster_utils import start_server
from tests.serving_utils import ServerThread, one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
SEED = 15
GENERATE_N, FORWARD_N, HTTP_N = 1000, 2000, 200  # at most, each; and at most BUDGET_S seconds each
BUDGET_S = 25.0
GENERATE_OK = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
FORWARD_OK = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,  # a stale placement generation
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # a message over the size limit (refused by gRPC itself)
}
GENERATE = "/expertmesh.v1.Generation/Generate"
FORWARD = "/expertmesh.v1.ExpertWorker/Forward"
I32, I64 = 2**31 - 1, 2**63 - 1


@pytest.fixture(scope="module")
def cluster():
    srv = start_server("cpu", WEIGHTS_DIR, 0, "--max-message-mb", "4")
    config = CoordinatorConfig(
        model_dir=str(WEIGHTS_DIR), port=0, http_port=0, max_context=96, default_max_new_tokens=3, max_queued_requests=64,
        cluster=ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),), timeout_s=10.0),
    )  # fmt: skip
    try:
        with ServerThread(config) as s:
            end = time.monotonic() + 60
            while health.check(s.addr, 1.0) != "SERVING":
                assert time.monotonic() < end, "the coordinator never became ready"
                time.sleep(0.1)
            yield s, srv
    finally:
        srv.stop()


# ---------------------------------------------------------------------- values


def _text(rng: random.Random, n: int) -> str:
    alphabet = ["a", " ", "hello", "é", "\u4e2d", "\U0001f600", "\x00", "\ufffd", "\n", "w1"]
    return "".join(rng.choice(alphabet) for _ in range(n))


def _size(rng: random.Random) -> int:
    return rng.choice([0, 1, 2, 3, 7, 16, 100, 300, 5000])


def _int(rng: random.Random, lo: int, hi: int) -> int:
    return rng.choice([lo, hi, 0, 1, -1 if lo < 0 else 0, rng.randint(lo, hi), rng.randint(0, 8)])


def _float(rng: random.Random) -> float:
    return rng.choice([0.0, 0.5, 1.0, 2.0, -1.0, 1e-30, 1e30, math.nan, math.inf, -math.inf, rng.random()])


# ---------------------------------------------------------------------- Generate


def _generate_request(rng: random.Random) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(prompt="hello world", max_new_tokens=rng.randint(1, 3))
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(["prompt", "input_ids", "temperature", "top_p", "top_k", "seed", "max_new_tokens",
                            "stop", "stop_token_ids", "flags", "lora", "request_id"])  # fmt: skip
        if field == "prompt":
            req.prompt = _text(rng, _size(rng))
        elif field == "input_ids":
            req.ClearField("prompt") if rng.random() < 0.7 else None
            req.input_ids[:] = [_int(rng, -(2**31), I32) for _ in range(_size(rng))]
        elif field in ("temperature", "top_p"):
            setattr(req, field, _float(rng))
        elif field == "top_k":
            req.top_k = _int(rng, -(2**31), I32)
        elif field == "seed":
            req.seed = _int(rng, 0, 2**64 - 1)
        elif field == "max_new_tokens":
            req.max_new_tokens = _int(rng, -(2**31), I32)
        elif field == "stop":
            req.stop[:] = [
                _text(rng, rng.choice([0, 1, 3, 300])) for _ in range(rng.choice([0, 1, 2, 17, 40]))
            ]
        elif field == "stop_token_ids":
            req.stop_token_ids[:] = [_int(rng, -(2**31), I32) for _ in range(rng.choice([0, 1, 5, 65]))]
        elif field == "flags":
            req.ignore_eos, req.logprobs = rng.random() < 0.5, rng.random() < 0.5
        elif field == "lora":
            req.lora = _text(rng, rng.choice([1, 5, 1000]))
        else:
            req.request_id = _text(rng, rng.choice([0, 5, 300]))
    return req


def _mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if op < 0.4 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.7:
            b[rng.randrange(len(b) + 1) : 0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif b:
            del b[rng.randrange(len(b)) :]
    return bytes(b)


def test_fuzz_generate(cluster):
    s, srv = cluster
    ch = grpc.insecure_channel(s.addr)
    stub = generation_pb2_grpc.GenerationStub(ch)
    raw_call = ch.unary_stream(GENERATE)  # bytes in, bytes out
    greedy = generation_pb2.GenerateRequest(prompt="hello world", max_new_tokens=8)
    before = [t for c in stub.Generate(greedy, timeout=60) for t in c.token_ids]
    rng = random.Random(SEED)
    seen: dict[grpc.StatusCode, int] = {}
    end = time.monotonic() + BUDGET_S
    n = 0
    while n < GENERATE_N and time.monotonic() < end:
        req = _generate_request(rng)
        raw = rng.random() < 0.25
        try:
            if raw:
                list(raw_call(_mutate_bytes(rng, req.SerializeToString()), timeout=5))
            else:
                list(stub.Generate(req, timeout=5))
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            assert code in GENERATE_OK, f"request {n} ({'raw ' if raw else ''}{req}): {code} {e.details()}"
        seen[code] = seen.get(code, 0) + 1
        n += 1
    print(f"{n} Generate requests: {seen}")
    assert n >= 300 and seen.get(grpc.StatusCode.OK) and seen.get(grpc.StatusCode.INVALID_ARGUMENT), seen
    assert srv.proc.poll() is None and health.check(s.addr) == "SERVING"
    after = [t for c in stub.Generate(greedy, timeout=60) for t in c.token_ids]
    assert after == before
    st = s.scheduler.stats()
    assert st["free_pages"] == st["total_pages"]


# ---------------------------------------------------------------------- Forward


def _tensor(rng: random.Random, t: torch.Tensor) -> tpb.Tensor:
    msg = wire.encode(t)
    for _ in range(rng.randint(0, 2)):
        op = rng.choice(["dtype", "shape", "dims", "data", "nan"])
        if op == "dtype":
            msg.dtype = rng.choice([*wire.DTYPES, "", "float64", "complex64", "x" * 300])
        elif op == "shape":
            msg.shape[:] = rng.choice([[], [0], [2**62, 2**62, 0], [-1, 2], [1] * 9, [2**31, 2**31],
                                       [s * rng.choice([1, 2]) for s in t.shape], list(reversed(t.shape))])  # fmt: skip
        elif op == "dims":
            msg.shape.append(rng.choice([0, 1, 2]))
        elif op == "data":
            k = rng.randint(1, 9)
            msg.data = msg.data[:-k] if rng.random() < 0.5 else msg.data + bytes(k)
        elif t.is_floating_point() and t.numel():
            bad = t.clone().view(-1)
            bad[rng.randrange(bad.numel())] = rng.choice([math.nan, math.inf, -math.inf, 1e38])
            msg.data = wire.encode(bad.view(t.shape)).data
    return msg


def _forward_request(
    rng: random.Random, gen: int, dtype: torch.dtype, h: int, slots: int
) -> pb.ForwardRequest:
    t, k = rng.choice([0, 1, 2, 5, 17]), rng.choice([1, 2, 8, 9])
    x = torch.randn(t, h).to(dtype)
    ids = torch.randint(-1, slots, (t, k), dtype=torch.int32)
    if rng.random() < 0.2 and t:
        ids.view(-1)[rng.randrange(t * k)] = rng.choice([-2, slots, 2**31 - 1, -(2**31)])
    w = torch.rand(t, k)
    msg = pb.ForwardRequest(seq=rng.randint(1, 2**64 - 1), generation=gen, layer=rng.choice([0, 1, 2, 3]))
    mutate = rng.random() < 0.8
    msg.hidden.CopyFrom(_tensor(rng, x) if mutate else wire.encode(x))
    msg.slot_ids.CopyFrom(_tensor(rng, ids) if mutate else wire.encode(ids))
    msg.weights.CopyFrom(_tensor(rng, w) if mutate else wire.encode(w))
    if rng.random() < 0.1:
        msg.adapter_slots.CopyFrom(_tensor(rng, torch.randint(-1, 3, (t,), dtype=torch.int32)))
    r = rng.random()
    if r < 0.1:
        msg.generation = rng.choice([0, gen + 1, gen - 1 if gen else 5, 2**64 - 1])
    elif r < 0.2:
        msg.layer = rng.choice([-1, 4, 1000, -(2**31), I32])
    elif r < 0.25:
        msg.fast_path = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 16, 256])))
        msg.seq = rng.choice([0, 1])
    return msg


def test_overflowing_shape_is_invalid_argument_and_counted(cluster):
    """The issue's case: [2^62, 2^62, 0] was UNKNOWN ("Storage size calculation overflowed") and
    not counted; malformed bytes were UNKNOWN (DecodeError)."""
    _, srv = cluster
    ch = grpc.insecure_channel(srv.address)
    stub = pb_grpc.ExpertWorkerStub(ch)
    info = wire.decode_info(stub.Describe(pb.DescribeRequest(), timeout=10))
    errors0 = stub.Stats(pb.StatsRequest(), timeout=10).errors
    msg = pb.ForwardRequest(seq=1, generation=info.generation, layer=0)
    msg.hidden.CopyFrom(tpb.Tensor(dtype=wire.dtype_name(info.dtype), shape=[2**62, 2**62, 0]))
    msg.slot_ids.CopyFrom(wire.encode(torch.zeros(0, 2, dtype=torch.int32)))
    msg.weights.CopyFrom(wire.encode(torch.zeros(0, 2)))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Forward(iter([msg]), timeout=10))
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hidden: dimension above" in e.value.details()
    )
    with pytest.raises(grpc.RpcError) as e:
        list(ch.stream_stream(FORWARD)(iter([b"\xff\xff\xff"]), timeout=10))
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed ForwardRequest" in e.value.details()
    )
    with pytest.raises(grpc.RpcError) as e:
        ch.unary_unary("/expertmesh.v1.ExpertWorker/ApplyPlacement")(b"\x0a\xff", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Stats(pb.StatsRequest(), timeout=10).errors - errors0 == 2


@pytest.mark.parametrize("method", ["ListServers", "LoadLoRA", "SetPlacement"])
def test_malformed_admin_bytes_are_invalid_argument(cluster, method):
    s, _ = cluster
    ch = grpc.insecure_channel(s.addr)
    # truncated; field 1 a string that is not UTF-8 (ListServersRequest has no field 1: unknown, fine)
    for raw in (b"\x0a\xff", b"\x0a\x02\xff\xfe")[: 1 if method == "ListServers" else 2]:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(f"/expertmesh.v1.Admin/{method}")(raw, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.value.details()
    assert health.check(s.addr) == "SERVING"


def test_fuzz_forward(cluster):
    s, srv = cluster
    ch = grpc.insecure_channel(srv.address, options=[("grpc.max_send_message_length", 64 << 20)])
    stub = pb_grpc.ExpertWorkerStub(ch)
    raw_call = ch.stream_stream(FORWARD)
    info = wire.decode_info(stub.Describe(pb.DescribeRequest(), timeout=10))
    gen, slots = info.generation, info.slot_capacity
    rng = random.Random(SEED + 1)
    good = _forward_request(random.Random(0), gen, info.dtype, info.hidden_size, slots)
    good.ClearField("adapter_slots"), good.ClearField("fast_path")
    good.hidden.CopyFrom(wire.encode(torch.randn(5, info.hidden_size).to(info.dtype)))
    good.slot_ids.CopyFrom(wire.encode(torch.randint(-1, slots, (5, 2), dtype=torch.int32)))
    good.weights.CopyFrom(wire.encode(torch.rand(5, 2)))
    good.generation, good.layer = gen, 0
    expect = wire.decode(list(stub.Forward(iter([good]), timeout=30))[0].output).clone()
    errors0 = stub.Stats(pb.StatsRequest(), timeout=10).errors
    seen: dict[grpc.StatusCode, int] = {}
    refused = 0
    end = time.monotonic() + BUDGET_S
    n = 0
    while n < FORWARD_N and time.monotonic() < end:
        msgs = [
            _forward_request(rng, gen, info.dtype, info.hidden_size, slots)
            for _ in range(rng.choice([1, 1, 3]))
        ]
        raw = rng.random() < 0.15
        try:
            if raw:
                list(raw_call(iter([_mutate_bytes(rng, m.SerializeToString()) for m in msgs]), timeout=10))
            else:
                list(stub.Forward(iter(msgs), timeout=10))
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            assert code in FORWARD_OK, f"request {n} ({'raw' if raw else msgs}): {code} {e.details()}"
            refused += not raw and code != grpc.StatusCode.RESOURCE_EXHAUSTED
        seen[code] = seen.get(code, 0) + 1
        n += 1
    print(f"{n} Forward streams: {seen}")
    assert n >= 300 and seen.get(grpc.StatusCode.OK) and seen.get(grpc.StatusCode.INVALID_ARGUMENT), seen
    assert srv.proc.poll() is None and health.check(srv.address) == "SERVING"
    # every refusal of a structured request was counted by the server (raw ones may be refused by gRPC)
    errors = stub.Stats(pb.StatsRequest(), timeout=10).errors - errors0
    assert refused <= errors <= refused + seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0), (refused, errors)
    out = wire.decode(list(stub.Forward(iter([good]), timeout=30))[0].output)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    # and the coordinator, which uses that server, still serves
    gstub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(s.addr))
    assert list(gstub.Generate(generation_pb2.GenerateRequest(prompt="hello", max_new_tokens=2), timeout=60))


# ---------------------------------------------------------------------- HTTP

_JSON = [None, 0, 1, -1, 2**31, 2**63, -(2**63), 1.5, 1e308, "x", "", "\u0000", "\ud800", [], {}, [1, 2], ["a"],
         [[1]], [[]], [2**40], [-5], True, {"a": 1}, "a" * 5000, [0] * 3000]  # fmt: skip
_INTS = [0, 1, 2, 16, 20, 21, 2**31 - 1, 2**31, 2**63 - 1, 2**64, -1]
_FLOATS = [0, 0.5, 1, 2, 2.5, -1, 1e308]
_PLAUSIBLE = {  # well-typed values, at and beyond every bound: they reach the handlers
    "max_tokens": _INTS, "max_completion_tokens": _INTS, "top_k": _INTS, "n": _INTS, "seed": _INTS,
    "logprobs": _INTS + [True], "top_logprobs": _INTS, "temperature": _FLOATS, "top_p": _FLOATS,
    "frequency_penalty": _FLOATS, "stream": [True, False], "echo": [True, False], "ignore_eos": [True, False],
    "stream_options": [{"include_usage": True}], "logit_bias": [{"1": 5}],
    "prompt": ["hi", "", [1, 2], [2**31], [2**40], [[1], [2]], ["a", "b"], "\ud800", [-1], [0] * 200],
    "stop": [["a"], "\ud800", ["a"] * 20, "", ["é" * 300]],
    "model": ["nope", "\ud800"],
}  # fmt: skip
_MESSAGES = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
             [{"role": "user"}], [{}], [], "hi", [{"role": "user", "content": None}],
             [{"role": "assistant", "content": "a", "name": "\ud800"}], [{"role": "tool", "content": "a"}]]  # fmt: skip
_HTTP_FIELDS = [*_PLAUSIBLE, "messages"]


def _http_value(rng: random.Random, field: str):
    if field == "messages":
        return rng.choice(_MESSAGES)
    return rng.choice(_PLAUSIBLE[field]) if rng.random() < 0.7 else rng.choice(_JSON)


_JSON_TYPE = {"content-type": "application/json"}


def test_fuzz_http(cluster):
    """Mutated OpenAI bodies: 200 or a 4xx in OpenAI's error shape, never a 500 (found: JSON
    integers beyond int32 for max_tokens/top_k/prompt ids, lone surrogates)."""
    s, _ = cluster
    base = f"http://127.0.0.1:{s.server.http.port}"
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(SEED + 2)
    seen: dict[int, int] = {}
    end = time.monotonic() + BUDGET_S / 3
    n = 0
    with httpx.Client(timeout=30) as http:
        while n < HTTP_N and time.monotonic() < end:
            chat = rng.random() < 0.5
            body: dict = {"model": model, "max_tokens": 2}
            body.update({"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"})
            for _ in range(rng.randint(1, 2)):
                f = rng.choice(_HTTP_FIELDS)
                body[f] = _http_value(rng, f)
            raw = json.dumps(body).encode()  # ASCII: "\ud800" stays an escape, as a client would send it
            r = http.post(
                f"{base}/v1/{'chat/completions' if chat else 'completions'}", content=raw, headers=_JSON_TYPE
            )
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.text[:300])
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text[:300]
            n += 1
    print(f"{n} HTTP requests: {seen}")
    assert n >= 100 and seen.get(200) and seen.get(400), seen
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
