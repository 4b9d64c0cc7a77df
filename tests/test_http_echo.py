"""Scoring a text, as accuracy harnesses do: lm-evaluation-harness's ``local-completions``
loglikelihood request (``echo`` with ``logprobs``, ``max_tokens`` 1 or 0, prompts as token ids)
answers each prompt token's log-probability equal to HF transformers' on the demo model
(float32, within 1e-4), the first one ``null``, ``text_offset`` filled; the gRPC API's
``prompt_logprobs`` gives the same numbers. Also: every refused request is counted in /metrics,
a refusal names its field, and an unknown route answers OpenAI's error object."""

from __future__ import annotations

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from coordinator.serving.server import CoordinatorConfig
from expertmesh.client import Client
from expertmesh.demo import write_demo_model
from tests.serving_utils import ServerThread, one_thread  # noqa: F401 (autouse fixture)

# longer than a step's token budget (16): the prompt is scored over several prefill chunks
PROMPTS = [[5, 17, 33, 2, 9, 100, 250, 3, 77, 41, 8, 19, 300, 12, 64, 7, 91, 23, 45, 6], [40, 41, 7, 500]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for ids in PROMPTS:
            lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [L, V]
            refs.append(lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1))  # [L - 1]
    cfg = CoordinatorConfig(
        model_dir=str(path), port=0, http_port=0, page_size=4, max_batch_tokens=16, dtype="float32"
    )
    with ServerThread(cfg) as s:
        assert s.server is not None and s.server.http is not None
        yield s, f"http://127.0.0.1:{s.server.http.port}", refs


def invalid_count(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "expertmesh_requests_total" and s.labels.get("status") == "invalid"
    )


def close(got: list[float], want: torch.Tensor) -> bool:
    return len(got) == len(want) and (torch.tensor(got) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request_matches_hf(served, max_tokens):
    _, base, refs = served
    body = {"model": "demo-model", "prompt": PROMPTS, "max_tokens": max_tokens, "logprobs": 1, "echo": True,
            "temperature": 0.0, "seed": 1234}  # fmt: skip
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == len(PROMPTS)
    for c, ids, ref in zip(choices, PROMPTS, refs):
        lp = c["logprobs"]
        n = len(ids) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert close(lp["token_logprobs"][1 : len(ids)], ref), (lp["token_logprobs"], ref)
        offsets = lp["text_offset"]
        assert len(offsets) == n and offsets[0] == 0 and offsets == sorted(offsets)
        # what lm-eval reads: the continuation's sum and whether each token was the greedy one
        ctxlen = 1
        cont = lp["token_logprobs"][ctxlen : len(ids)]
        assert abs(sum(cont) - ref[ctxlen - 1 :].sum().item()) < 1e-3
        for tok_lp, top in zip(cont, lp["top_logprobs"][ctxlen : len(ids)]):
            assert len(top) == 1 and max(top.values()) >= tok_lp - 1e-6
        assert c["finish_reason"] == "length"
    if max_tokens == 0:
        assert r.json()["usage"]["completion_tokens"] == 0


def test_echo_returns_the_prompt_text_first(served):
    _, base, _ = served
    r = httpx.post(base + "/v1/completions", json={"model": "demo-model", "prompt": "Once upon a time",
                   "max_tokens": 4, "echo": True, "temperature": 0})  # fmt: skip
    plain = httpx.post(base + "/v1/completions", json={"model": "demo-model", "prompt": "Once upon a time",
                       "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert r.status_code == plain.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Once upon a time" + plain.json()["choices"][0]["text"]
    r = httpx.post(base + "/v1/completions", json={"model": "demo-model", "prompt": "Once upon a time",
                   "max_tokens": 0, "echo": True})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Once upon a time", r.text


def test_grpc_prompt_logprobs_match_hf(served):
    s, _, refs = served
    with Client(s.addr, timeout=60) as c:
        for ids, ref in zip(PROMPTS, refs):
            scored = c.generate(input_ids=ids, max_new_tokens=0, prompt_logprobs=True)
            assert scored.token_ids == [] and scored.finish_reason == "length"
            assert scored.prompt_logprobs is not None and close(scored.prompt_logprobs, ref)
            both = c.generate(input_ids=ids, max_new_tokens=3, prompt_logprobs=True, logprobs=True)
            assert both.prompt_logprobs is not None and close(both.prompt_logprobs, ref)
            assert len(both.token_ids) == 3


def test_refusals_are_counted_and_name_their_field(served):
    _, base, _ = served
    before = invalid_count(base)
    cases = [
        ({"model": "demo-model", "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
        ({"model": "demo-model", "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": "demo-model", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ]
    for body, status, param in cases:
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
    assert invalid_count(base) == before + len(cases)
    r = httpx.get(base + "/v1/nowhere", timeout=10)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and "/v1/nowhere" in err["message"], r.text
