"""The coordinator's OpenAI-compatible HTTP API, driven by the real ``openai`` client against a
live in-process coordinator serving the demo model: completions and chat, streaming and not,
usage, logprobs, greedy output equal to the gRPC API's, OpenAI error statuses, and a client
that disconnects mid-stream getting its request cancelled and its KV pages freed."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.serving.server import CoordinatorConfig
from expertmesh.client import Client
from expertmesh.demo import write_demo_model
from tests.serving_utils import ServerThread, one_thread  # noqa: F401 (autouse fixture)

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")
    cfg = CoordinatorConfig(model_dir=str(path), port=0, http_port=0, page_size=4, max_batch_tokens=64)
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def base_url(server) -> str:
    assert server.server is not None and server.server.http is not None
    return f"http://127.0.0.1:{server.server.http.port}"


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def scrape(base_url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client's parser: {"name{label=value,...}": value}."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def same_usage(later, earlier) -> bool:
    """Token counts equal; the later request of the same prompt found at least as much of it in
    the prefix cache."""
    strip = {"prompt_tokens_details"}
    return (
        later.model_dump(exclude=strip) == earlier.model_dump(exclude=strip)
        and later.prompt_tokens_details.cached_tokens >= earlier.prompt_tokens_details.cached_tokens
    )


def test_models_and_health(oai, base_url):
    models = oai.models.list().data
    assert [m.id for m in models] == ["demo-model"]
    assert httpx.get(base_url + "/health").status_code == 200


def test_completion_greedy_equals_grpc(server, oai):
    with Client(server.addr) as c:
        ref = c.generate(PROMPT, max_new_tokens=16, logprobs=True)
    out = oai.completions.create(model="demo-model", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2)
    ch = out.choices[0]
    assert ch.text == ref.text and ch.text
    assert ch.finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens
    assert out.usage.completion_tokens == ref.usage.completion_tokens == len(ch.logprobs.tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert ch.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-6)
    # greedy: the chosen token is the most likely of the top 2, with the same logprob
    for tok, lp, top in zip(ch.logprobs.tokens, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp) and top[tok] == pytest.approx(lp)
    # the prompt as token ids gives the same completion
    ids = server.server.tokenizer.encode(PROMPT)
    by_ids = oai.completions.create(model="demo-model", prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == ch.text


def test_completion_stream_with_usage(oai):
    whole = oai.completions.create(model="demo-model", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        oai.completions.create(
            model="demo-model", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert same_usage(chunks[-1].usage, whole.usage)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_and_not(oai, server):
    msgs = [{"role": "user", "content": "Good morning, Pip!"}]
    whole = oai.chat.completions.create(model="demo-model", messages=msgs, max_tokens=16, temperature=0)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    stream = oai.chat.completions.create(
        model="demo-model", messages=msgs, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert same_usage(chunks[-1].usage, whole.usage)
    # the prompt is the template's text: the same as sending it to the gRPC API (it writes BOS)
    rendered = server.server.chat_template.render(msgs)
    ids = server.server.tokenizer.tok.encode(rendered, add_special_tokens=False).ids
    assert whole.usage.prompt_tokens == len(ids)
    with Client(server.addr) as c:
        assert c.generate(input_ids=ids, max_new_tokens=16).text == msg.content


def test_chat_content_parts_are_text(oai):
    plain = [{"role": "user", "content": "Good morning, Pip!"}]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Good morning, "}, {"type": "text", "text": "Pip!"}],
        }
    ]
    a, b = (
        oai.chat.completions.create(model="demo-model", messages=m, max_tokens=6, temperature=0)
        for m in (plain, parts)
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_logprobs(oai):
    out = oai.chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)


def test_n_seed_and_stop(oai):
    kw = dict(model="demo-model", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=3)
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: repeatable
    assert len({c.text for c in a.choices}) > 1  # each choice its own seed
    full = oai.completions.create(model="demo-model", prompt=PROMPT, max_tokens=12, temperature=0)
    word = full.choices[0].text.split()[2]
    cut = oai.completions.create(model="demo-model", prompt=PROMPT, max_tokens=12, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and word not in cut.choices[0].text
    assert full.choices[0].text.startswith(cut.choices[0].text)


@pytest.mark.parametrize(
    "kw, status, param",
    [
        (dict(temperature=-1), 400, "temperature"),
        (dict(top_p=0), 400, "top_p"),
        (dict(max_tokens=0), 400, "max_tokens"),
        (dict(max_tokens=100000), 400, None),
        (dict(n=0), 400, "n"),
        (dict(presence_penalty=0.5), 400, "presence_penalty"),
        (dict(prompt=[]), 400, "prompt"),
        (dict(prompt=[5, 100000]), 400, None),
        (dict(model="no-such-model"), 404, "model"),
    ],
)
def test_bad_parameters(oai, kw, status, param):
    args = {"model": "demo-model", "prompt": PROMPT, "max_tokens": 4, **kw}
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(**args)
    assert e.value.status_code == status
    err = e.value.body
    assert isinstance(err, dict) and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    # the server keeps serving
    assert (
        oai.completions.create(model="demo-model", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    )


def test_bad_chat(oai):
    with pytest.raises(openai.BadRequestError):  # the demo template knows three roles
        oai.chat.completions.create(
            model="demo-model", messages=[{"role": "tool", "content": "x"}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="demo-model", messages=[], max_tokens=2)


def test_disconnect_mid_stream_frees_the_request(oai, base_url):
    before = scrape(base_url)
    stream = oai.completions.create(
        model="demo-model", prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )  # fmt: skip
    for got, _chunk in enumerate(stream, 1):
        if got == 3:
            break
    during = scrape(base_url)
    assert during["expertmesh_requests_running"] == 1 and during["expertmesh_kv_pages_used"] > 0
    stream.close()
    deadline = time.monotonic() + 20
    while True:
        m = scrape(base_url)
        if m["expertmesh_kv_pages_used"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m["expertmesh_kv_pages_used"] == 0 and m["expertmesh_requests_running"] == 0
    cancelled = "expertmesh_requests_total{status=cancelled}"
    assert m[cancelled] == before[cancelled] + 1
    # it stopped long before its 400 tokens
    assert m["expertmesh_generation_tokens_total"] - before["expertmesh_generation_tokens_total"] < 400


def test_disconnect_before_a_whole_response_frees_the_request(base_url):
    before = scrape(base_url)
    body = {"model": "demo-model", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(base_url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    deadline = time.monotonic() + 20
    cancelled = "expertmesh_requests_total{status=cancelled}"
    while True:
        m = scrape(base_url)
        if m[cancelled] > before[cancelled] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m[cancelled] == before[cancelled] + 1
    assert m["expertmesh_kv_pages_used"] == 0 and m["expertmesh_requests_running"] == 0
    assert m["expertmesh_generation_tokens_total"] - before["expertmesh_generation_tokens_total"] < 400


def test_failure_mid_stream_is_an_error_event(server, base_url):
    engine = server.scheduler.engine
    real, calls = engine.step, []

    def failing(*a, **kw):  # the third step of this request fails (as an expert server loss would)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real(*a, **kw)

    engine.step = failing
    try:
        body = {"model": "demo-model", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stream": True}
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    finally:
        del engine.step  # back to the class's method
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "injected step failure" in err["message"] and err["type"] == "server_error"
    assert all("choices" in json.loads(e) for e in events[:-2])


def test_prefix_cache_usage_and_metrics(server, oai, base_url):
    """A repeated prompt: the second request's usage (HTTP and gRPC) says which prompt tokens
    came from the prefix cache, /metrics counts them and the cache's pages; the text is the same."""
    prompt = "The prefix cache keeps whole pages of this rather long prompt for the next request"
    n = len(server.server.tokenizer.encode(prompt))
    page = 4  # the fixture's page size
    before = scrape(base_url)
    first = oai.completions.create(model="demo-model", prompt=prompt, max_tokens=8, temperature=0)
    again = oai.completions.create(model="demo-model", prompt=prompt, max_tokens=8, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every whole page but the one holding the last prompt token, which is computed again
    want = (n - 1) // page * page
    assert want > 0 and again.usage.prompt_tokens_details.cached_tokens == want
    with Client(server.addr) as c:
        out = c.generate(prompt, max_new_tokens=8)
    assert out.text == first.choices[0].text and out.usage.cached_tokens == want
    after = scrape(base_url)
    grew = {k: after[k] - before[k] for k in ("expertmesh_prompt_tokens_cached_total",
                                              "expertmesh_prompt_tokens_computed_total")}  # fmt: skip
    assert grew == {
        "expertmesh_prompt_tokens_cached_total": 2 * want,
        "expertmesh_prompt_tokens_computed_total": 3 * n - 2 * want,
    }
    assert after["expertmesh_prefix_cache_pages"] >= want // page
