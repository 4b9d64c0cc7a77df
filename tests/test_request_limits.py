"""Hostile input to the coordinator: every per-request quantity a client controls is
capped with INVALID_ARGUMENT before work proportional to it is done, a long prompt is tokenized
without stalling the event loop, and a request protobuf cannot parse (invalid UTF-8) is
INVALID_ARGUMENT naming the field, not UNKNOWN."""

from __future__ import annotations

import random
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer, decoders, models

from coordinator.serving.requests import (
    InputLimits,
    InvalidRequest,
    RequestLimits,
    decode_generate_request,
    parse_request,
)
from coordinator.serving.server import CoordinatorConfig
from coordinator.serving.tokenizer import IncrementalDetokenizer, StopMatcher, TextTokenizer
from expertmesh.client import Client
from expertmesh.demo import WEIGHTS_DIR
from expertmesh.v1 import generation_pb2
from tests.serving_utils import ServerThread, one_thread  # noqa: F401  (fixture)

SMALL = InputLimits(
    max_prompt_bytes=64, max_stop_strings=3, max_stop_bytes=8, max_stop_token_ids=4, max_request_id_bytes=16
)
GENERATE = "/expertmesh.v1.Generation/Generate"


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    t = TextTokenizer.from_dir(WEIGHTS_DIR)
    assert t is not None
    return t


# ---------------------------------------------------------------------- limits, in process

OVER = {
    # name: (request fields, words the message must contain)
    "prompt bytes": (dict(prompt="é" * 40), ["40 characters", "limit of 64 bytes", "--max-prompt-bytes"]),
    "prompt characters": (dict(prompt="a" * 1000), ["1000 characters", "--max-prompt-bytes"]),
    "stop count": (dict(prompt="a", stop=["x"] * 4), ["4 stop strings", "limit of 3", "--max-stop-strings"]),
    "stop length": (dict(prompt="a", stop=["ok", "é" * 5]), ["limit of 8 bytes", "--max-stop-bytes"]),
    "stop token ids": (dict(input_ids=[1], stop_token_ids=[1] * 5), ["5 stop_token_ids", "limit of 4"]),
    "request id": (dict(input_ids=[1], request_id="r" * 17), ["limit of 16 bytes", "--max-request-id-bytes"]),
    "input ids": (dict(input_ids=[1] * 100), ["100 tokens", "max context of 100"]),
}


@pytest.mark.parametrize("name", OVER)
def test_each_limit_is_enforced_with_its_value_in_the_message(name, tok):
    fields, words = OVER[name]
    limits = RequestLimits(vocab_size=768, max_context=100, default_max_new_tokens=8, input=SMALL)
    with pytest.raises(InvalidRequest) as e:
        parse_request(generation_pb2.GenerateRequest(**fields), limits, tok)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_requests_at_the_limits_pass(tok):
    limits = RequestLimits(vocab_size=768, max_context=100, default_max_new_tokens=8, input=SMALL)
    req = generation_pb2.GenerateRequest(
        prompt="é" * 32, stop=["12345678", "é" * 4, "z"], stop_token_ids=[1, 2, 3, 4], request_id="r" * 16
    )
    ids, params = parse_request(req, limits, tok)
    assert ids == tok.tok.encode("é" * 32).ids  # the tokenizers library's own encode: the reference
    assert params.stop == ("12345678", "é" * 4, "z") and params.stop_token_ids == (1, 2, 3, 4)


def test_encode_matches_the_tokenizers_library_and_counts_before_listing(tok):
    text = "Once upon a time, a fox met a crow. " * 50
    assert tok.encode(text) == tok.tok.encode(text).ids
    n = len(tok.tok.encode(text).ids)
    assert tok.encode(text, max_tokens=n) == tok.tok.encode(text).ids
    with pytest.raises(ValueError, match=f"prompt of {n} tokens"):
        tok.encode(text, max_tokens=n - 1)


# ---------------------------------------------------------------------- undecodable requests


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (payload < 128 bytes)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize(
    "raw, where",
    [
        (_field(1, b"ab\xff"), "prompt is not valid UTF-8"),
        (_field(8, b"ok") + _field(8, b"\xc3"), "stop[1] is not valid UTF-8"),
        (_field(12, b"\xe2\x82"), "lora is not valid UTF-8"),
        (_field(13, b"\x80"), "request_id is not valid UTF-8"),
        (b"\x0a\x05ab", "malformed GenerateRequest"),  # truncated field
    ],
)
def test_undecodable_requests_name_the_field(raw, where):
    got = decode_generate_request(raw)
    assert isinstance(got, InvalidRequest) and where in str(got), got
    ok = generation_pb2.GenerateRequest(prompt="é", stop=["x"], request_id="r")
    assert decode_generate_request(ok.SerializeToString()) == ok


# ---------------------------------------------------------------------- text pieces


def _partial_suffix_reference(stops: tuple[str, ...], buf: str) -> int:
    """The longest suffix of buf that is a proper prefix of a stop string, by brute force."""
    return max(
        (n for s in stops for n in range(1, min(len(s) - 1, len(buf)) + 1) if buf.endswith(s[:n])), default=0
    )


def test_stop_matcher_partial_suffix_equals_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        stops = tuple(
            "".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))
        )
        buf = "".join(rng.choice("abc") for _ in range(rng.randint(0, 9)))
        assert StopMatcher(stops)._partial_suffix(buf) == _partial_suffix_reference(stops, buf), (stops, buf)


def _byte_tokenizer() -> TextTokenizer:
    """Byte tokens <0xNN> decoded by ByteFallback: incomplete UTF-8 decodes to U+FFFD."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<0x00>"))
    t.decoder = decoders.ByteFallback()
    return TextTokenizer(t)


def test_detokenizer_holds_an_incomplete_character_but_not_forever():
    tok = _byte_tokenizer()
    d = IncrementalDetokenizer(tok, [])
    assert [d.push(b) for b in b"\xe2\x82\xac"] == ["", "", "€"]  # a character split over 3 tokens
    pieces = [d.push(0xE2) for _ in range(40)]  # lead bytes that never complete a character
    assert "".join(pieces), "text held back for 40 tokens"
    assert len(d.ids) - d.start <= 16, "the decode window grew with the request"


# ---------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server():
    config = CoordinatorConfig(
        model_dir=str(WEIGHTS_DIR), port=0, http_port=0, input_limits=InputLimits(max_prompt_bytes=16 << 20)
    )
    with ServerThread(config) as s:
        yield s


def _health_latencies(addr: str, stop: threading.Event, out: list[float]) -> None:
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while not stop.is_set():
            t0 = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=60)
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)


def _send_huge(server, api: str, prompt: str) -> str:
    """Sends ``prompt`` through ``api``; returns the error text (the request must fail)."""
    if api == "grpc":
        with Client(server.addr, max_message_mb=64) as c, pytest.raises(grpc.RpcError) as e:
            c.generate(prompt=prompt)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return e.value.details()
    base = f"http://127.0.0.1:{server.server.http.port}/v1/"
    model = httpx.get(base + "models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt} if api == "completions" else {"model": model}
    if api == "chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    r = httpx.post(base + api, json=body, timeout=120)
    assert r.status_code == 400, r.text[:300]
    return r.text


@pytest.mark.parametrize("api", ["grpc", "completions", "chat/completions"])
def test_a_huge_prompt_does_not_stall_health(server, api):
    """While a prompt of ~2 MB is tokenized (seconds of CPU) and then rejected for its token
    count, health checks keep answering: tokenizing on the event loop (or holding the GIL while
    tokenizing) would hold them for the whole tokenization."""
    prompt = "Once upon a time, a fox met a crow by the river. " * 40_000  # ~2 MB
    latencies: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_health_latencies, args=(server.addr, stop, latencies))
    with Client(server.addr) as c:
        c.generate(input_ids=[3, 4], max_new_tokens=2)  # warm
        poller.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        details = _send_huge(server, api, prompt)
        took = time.perf_counter() - t0
        time.sleep(0.2)
        stop.set()
        poller.join(60)
        assert "does not fit the max context" in details, details[:300]
        assert c.generate(input_ids=[3, 4], max_new_tokens=2).finish_reason == "length"
    worst = max(latencies)
    print(
        f"big prompt rejected after {took:.2f} s; {len(latencies)} health checks, worst {worst * 1e3:.0f} ms"
    )
    assert len(latencies) >= 5
    assert worst < max(0.3, took / 4), f"health stalled {worst:.2f} s during a {took:.2f} s tokenization"


def test_over_size_input_is_rejected_before_any_work(server):
    with Client(server.addr, max_message_mb=64) as c:
        t0 = time.perf_counter()
        for kw, words in [
            (dict(prompt="x" * (20 << 20)), "--max-prompt-bytes"),
            (dict(input_ids=[1] * 3_000_000), "does not fit the max context"),
            (dict(input_ids=[1], stop=["s"] * 100_000), "--max-stop-strings"),
            (dict(input_ids=[1], request_id="r" * (1 << 20)), "--max-request-id-bytes"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                c.generate(**kw)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
            assert len(e.value.details()) < 300
        took = time.perf_counter() - t0
    assert took < 10, f"{took=:.1f} s"


@pytest.mark.parametrize("raw", [_field(1, b"w\xff"), _field(8, b"\xc3") + b"\x12\x01\x05"])
def test_invalid_utf8_is_invalid_argument_and_the_server_keeps_serving(server, raw):
    with grpc.insecure_channel(server.addr) as ch:
        call = ch.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    assert "not valid UTF-8" in e.value.details()
    with Client(server.addr) as c:
        assert c.generate(prompt="Once upon a time", max_new_tokens=3, request_id="ok").request_id == "ok"
