"""Every per-request cap answers INVALID_ARGUMENT on gRPC and 400 (OpenAI's error JSON) on HTTP
with the same words; an HTTP body over ``--max-http-body-bytes`` is 413 (by Content-Length or
counted while a chunked body arrives), a body that is not UTF-8 or a string with a lone surrogate
is 400, never a 500; the coordinator keeps serving."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from coordinator.serving.requests import InputLimits
from coordinator.serving.server import CoordinatorConfig
from expertmesh.demo import WEIGHTS_DIR
from expertmesh.v1 import generation_pb2, generation_pb2_grpc
from tests.serving_utils import ServerThread, one_thread  # noqa: F401  (fixture)

LIMITS = InputLimits(
    max_prompt_bytes=64, max_stop_strings=3, max_stop_bytes=8, max_stop_token_ids=4, max_request_id_bytes=16,
    max_body_bytes=4096,
)  # fmt: skip


@pytest.fixture(scope="module")
def coord():
    config = CoordinatorConfig(
        model_dir=str(WEIGHTS_DIR), port=0, http_port=0, max_context=256, input_limits=LIMITS
    )
    with ServerThread(config) as s:
        base = f"http://127.0.0.1:{s.server.http.port}"
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        yield s, base, model


# name: (gRPC fields, HTTP /v1/completions fields or None where HTTP has no such field, words)
CAPS = {
    "prompt bytes": (dict(prompt="é" * 40), dict(prompt="é" * 40), "--max-prompt-bytes"),
    "stop count": (dict(prompt="a", stop=["x"] * 4), dict(prompt="a", stop=["x"] * 4), "--max-stop-strings"),
    "stop length": (dict(prompt="a", stop=["é" * 5]), dict(prompt="a", stop=["é" * 5]), "--max-stop-bytes"),
    "stop ids": (dict(input_ids=[1], stop_token_ids=[1] * 5), None, "--max-stop-token-ids"),
    "request id": (dict(input_ids=[1], request_id="r" * 17), None, "--max-request-id-bytes"),
    "max tokens": (
        dict(prompt="a", max_new_tokens=1000),
        dict(prompt="a", max_tokens=1000),
        "max context of 256",
    ),
    "max tokens <= 0": (
        dict(prompt="a", max_new_tokens=0),
        dict(prompt="a", max_tokens=0),
        "must be positive",
    ),
    "context": (dict(input_ids=[1] * 300), dict(prompt=[1] * 300), "max context of 256"),
    "vocabulary": (dict(input_ids=[10**6]), dict(prompt=[10**6]), "outside the vocabulary"),
}


HTTP_WORDS = {"max tokens <= 0": "max_tokens 0 needs echo"}  # HTTP: 0 scores an echoed prompt


@pytest.mark.parametrize("name", CAPS)
def test_each_cap_is_invalid_argument_and_400(coord, name):
    s, base, model = coord
    fields, http_fields, words = CAPS[name]
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(s.addr))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), (
        e.value.details()
    )
    if http_fields is not None:
        r = httpx.post(f"{base}/v1/completions", json={"model": model, **http_fields}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and HTTP_WORDS.get(name, words) in err["message"]


def test_logprob_counts_are_capped_on_http(coord):
    _, base, model = coord
    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "a", "logprobs": 21}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "a"}],
        "logprobs": True,
        "top_logprobs": 21,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"], r.text


def _assert_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]  # OpenAI's shape, not FastAPI's {"detail": ...}
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}, err


def test_body_size_limit_is_413(coord):
    _, base, model = coord
    big = json.dumps({"model": model, "prompt": "a" * 5000}).encode()
    r = httpx.post(
        f"{base}/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=30
    )
    _assert_error(r, 413, "exceeds the limit of 4096 bytes (--max-http-body-bytes)")

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    r = httpx.post(f"{base}/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    _assert_error(r, 413, "more than 4096 bytes")


BAD_TEXT = [
    (b'{"model":"M","prompt":"\xff\xfe"}', "not valid UTF-8 (invalid start byte at byte"),
    (b'{"model":"M","messages":[{"role":"user","content":"\xc3("}]}', "not valid UTF-8"),
    (b'{"model":"M","prompt":"\\ud800"}', "prompt is not valid Unicode"),
    (b'{"model":"M","prompt":"a","stop":["ok","\\udfff"]}', "stop[1] is not valid Unicode"),
    (b'{"model":"M","messages":[{"role":"user","content":"x\\udc00"}]}', "lone surrogate"),
]


@pytest.mark.parametrize(("body", "words"), BAD_TEXT)
def test_text_that_is_not_unicode_is_400(coord, body, words):
    _, base, model = coord
    path = "chat/completions" if b"messages" in body else "completions"
    body = body.replace(b'"M"', json.dumps(model).encode())
    r = httpx.post(
        f"{base}/v1/{path}", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    _assert_error(r, 400, words)
    ok = httpx.post(
        f"{base}/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 2}, timeout=30
    )
    assert ok.status_code == 200 and httpx.get(f"{base}/health", timeout=10).status_code == 200
