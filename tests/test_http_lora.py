"""A LoRA adapter selected by ``model`` through the real ``openai`` client: listed by
/v1/models, its greedy completion equal to the gRPC API's with ``lora`` set (and different from
the base model's), an unknown name a 404."""

from __future__ import annotations

import openai
import pytest
import torch

from coordinator.serving.server import CoordinatorConfig
from expertmesh.client import Client
from tests import lora_utils
from tests.serving_utils import ServerThread, one_thread  # noqa: F401 (autouse fixture)

PROMPT = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_http")
    hf = lora_utils.make_model("qwen3_moe", tmp / "model")
    adapter = lora_utils.save(lora_utils.wrap(hf, seed=1), tmp / "adapters" / "a")
    cfg = CoordinatorConfig(
        model_dir=str(tmp / "model"), port=0, http_port=0, page_size=4, lora_dirs=(str(tmp / "adapters"),)
    )
    with ServerThread(cfg) as s:
        s.server.lora.load("story", str(adapter))
        url = f"http://127.0.0.1:{s.server.http.port}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
            yield s, c


def test_model_selects_the_adapter(served):
    s, oai = served
    assert [m.id for m in oai.models.list().data] == ["model", "story"]

    def http(model: str) -> list[float]:
        out = oai.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].logprobs.token_logprobs

    with Client(s.addr) as c:
        ref = c.generate(input_ids=PROMPT, max_new_tokens=8, lora="story", logprobs=True, ignore_eos=True)
        base = c.generate(input_ids=PROMPT, max_new_tokens=8, logprobs=True, ignore_eos=True)
    assert http("story") == pytest.approx(ref.logprobs, abs=1e-5)
    assert http("model") == pytest.approx(base.logprobs, abs=1e-5)
    assert ref.logprobs != pytest.approx(base.logprobs, abs=1e-3)  # the adapter changes the model
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)


def test_load_and_unload_over_http(served, tmp_path):
    import httpx

    s, oai = served
    base = str(oai.base_url).rstrip("/")
    adapters = s.config.lora_dirs[0]
    r = httpx.post(f"{base}/load_lora_adapter", json={"lora_name": "again", "lora_path": f"{adapters}/a"})
    assert r.status_code == 200, r.text
    assert "again" in [m.id for m in oai.models.list().data]
    assert oai.completions.create(model="again", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
    r = httpx.post(f"{base}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 403 and r.json()["error"]["message"]  # outside --lora-dir
    r = httpx.post(f"{base}/unload_lora_adapter", json={"lora_name": "again"})
    assert r.status_code == 200, r.text
    assert "again" not in [m.id for m in oai.models.list().data]
    r = httpx.post(f"{base}/unload_lora_adapter", json={"lora_name": "again"})
    assert r.status_code == 404
