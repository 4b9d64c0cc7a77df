"""The coordinator's public API in process: batching invariance and logprobs against HF
transformers, KV pressure, cancellation, request validation, seeded sampling, text, admin."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from coordinator.serving.requests import InvalidRequest, RequestLimits, parse_request
from coordinator.serving.server import CoordinatorConfig
from expertmesh import health
from expertmesh.client import AsyncClient, Client
from expertmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2
from tests.hf_models import make_checkpoint
from tests.serving_utils import (
    ServerThread,
    hf_greedy,
    one_thread,  # noqa: F401 (autouse fixture)
    write_word_tokenizer,
)

NUM_REQUESTS = 16
# prompt lengths 3..33 and output lengths 4..20, all different mixes
PROMPTS = [
    torch.randint(0, 96, (3 + 2 * i,), generator=torch.Generator().manual_seed(i)).tolist()
    for i in range(NUM_REQUESTS)
]
OUT_LENS = [4 + (i * 5) % 17 for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("qwen3_moe")
    make_checkpoint("qwen3_moe", path)
    write_word_tokenizer(path)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    refs = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, OUT_LENS)]
    return path, refs


def config(path, **kw) -> CoordinatorConfig:
    base = dict(model_dir=str(path), port=0, page_size=4, max_batch_tokens=32, max_running=16)
    return CoordinatorConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(config(model[0])) as s:
        yield s


def wait_idle(s: ServerThread, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = s.scheduler.stats()
        if (st["running"] == 0 and st["waiting"] == 0) or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


async def run_concurrently(addr: str, logprobs: bool) -> list:
    async with AsyncClient(addr) as c:
        return await asyncio.gather(
            *(
                c.generate(input_ids=p, max_new_tokens=n, logprobs=logprobs, ignore_eos=True)
                for p, n in zip(PROMPTS, OUT_LENS)
            )
        )


def check_against_hf(results, refs) -> None:
    for i, (r, (ref_toks, ref_lsm)) in enumerate(zip(results, refs)):
        assert r.token_ids == ref_toks, f"request {i}"
        assert r.finish_reason == "length"
        assert r.usage.prompt_tokens == len(PROMPTS[i]) and r.usage.completion_tokens == OUT_LENS[i]
        if r.logprobs is not None:
            want = ref_lsm.gather(1, torch.tensor(ref_toks)[:, None]).squeeze(1)
            assert (torch.tensor(r.logprobs) - want).abs().max().item() < 1e-4, f"request {i}"


def test_batching_invariance_and_logprobs_match_hf(server, model):
    _, refs = model
    with Client(server.addr) as c:
        alone = [
            c.generate(input_ids=p, max_new_tokens=n, ignore_eos=True) for p, n in zip(PROMPTS, OUT_LENS)
        ]
    steps_before = server.scheduler.stats()["steps"]
    together = asyncio.run(run_concurrently(server.addr, logprobs=True))
    steps = server.scheduler.stats()["steps"] - steps_before
    # continuous batching: far fewer steps than the requests' tokens one by one
    assert steps < sum(OUT_LENS) / 2, steps
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    check_against_hf(together, refs)
    st = wait_idle(server)
    assert st["free_pages"] == st["total_pages"]


def test_kv_pressure_preempts_and_stays_correct(model):
    path, refs = model
    from coordinator.model.kv_cache import KVCacheSpec
    from expertmesh.config import ModelConfig

    page_bytes = KVCacheSpec.bytes_per_page(ModelConfig.from_dir(path), 4, torch.float32)
    demand = sum(-(-(len(p) + n) // 4) for p, n in zip(PROMPTS, OUT_LENS))
    with ServerThread(config(path, kv_memory_bytes=20 * page_bytes)) as s:
        assert s.scheduler.stats()["total_pages"] == 20 < demand
        results = asyncio.run(run_concurrently(s.addr, logprobs=True))
        check_against_hf(results, refs)
        st = wait_idle(s)
        assert st["preemptions"] > 0
        assert st["free_pages"] == st["total_pages"] == 20


def test_cancel_frees_pages(server):
    with Client(server.addr) as c:
        stream = c.stream(input_ids=[5, 6, 7, 8, 9], max_new_tokens=200, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        assert server.scheduler.stats()["running"] == 1
        stream.close()  # cancels the call
        st = wait_idle(server)
        assert st["running"] == 0 and st["free_pages"] == st["total_pages"]

        # async cancellation: the task is cancelled mid-stream
        async def cancel_midway():
            async with AsyncClient(server.addr) as ac:
                got = []

                async def consume():
                    async for ch in ac.stream(input_ids=[1, 2, 3], max_new_tokens=200, ignore_eos=True):
                        got.append(ch)

                task = asyncio.create_task(consume())
                while len(got) < 2:
                    await asyncio.sleep(0.005)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(cancel_midway())
        st = wait_idle(server)
        assert st["running"] == 0 and st["free_pages"] == st["total_pages"]
        assert c.generate(input_ids=[1, 2], max_new_tokens=3).finish_reason == "length"


INVALID = {
    "oversize prompt": dict(input_ids=[1] * 256),
    "max_new_tokens 0": dict(input_ids=[1, 2], max_new_tokens=0),
    "max_new_tokens absurd": dict(input_ids=[1, 2], max_new_tokens=10**9),
    "negative temperature": dict(input_ids=[1, 2], temperature=-0.5),
    "top_p 0": dict(input_ids=[1, 2], top_p=0.0),
    "top_p above 1": dict(input_ids=[1, 2], top_p=1.5),
    "negative top_k": dict(input_ids=[1, 2], top_k=-2),
    "empty input": dict(),
    "empty prompt text": dict(prompt=""),
    "prompt and input_ids": dict(prompt="w1 w2", input_ids=[1, 2]),
    "id above vocab": dict(input_ids=[1, 96]),
    "negative id": dict(input_ids=[-1, 3]),
    "stop token above vocab": dict(input_ids=[1], stop_token_ids=[1000]),
    "empty stop string": dict(input_ids=[1], stop=[""]),
    "unknown lora": dict(input_ids=[1, 2], lora="my-adapter"),
}


def test_invalid_requests_are_rejected_and_server_keeps_serving(server):
    with Client(server.addr) as c:
        for name, kw in INVALID.items():
            with pytest.raises(grpc.RpcError) as e:
                c.generate(**kw)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert e.value.details(), name
            print(f"{name}: {e.value.details()}")
        ok = c.generate(input_ids=[3, 4, 5], max_new_tokens=4, request_id="abc")
        assert ok.finish_reason == "length" and len(ok.token_ids) == 4 and ok.request_id == "abc"
    st = wait_idle(server)
    assert st["free_pages"] == st["total_pages"]


def test_unknown_adapter_message(server):
    with Client(server.addr) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(input_ids=[1, 2], lora="my-adapter")
    assert "unknown adapter" in e.value.details()


def test_text_prompt_needs_a_tokenizer():
    limits = RequestLimits(vocab_size=96, max_context=64, default_max_new_tokens=8)
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        parse_request(generation_pb2.GenerateRequest(prompt="hello"), limits, None)
    with pytest.raises(InvalidRequest, match="need a tokenizer"):
        parse_request(generation_pb2.GenerateRequest(input_ids=[1], stop=["x"]), limits, None)
    ids, params = parse_request(generation_pb2.GenerateRequest(input_ids=[1] * 60), limits, None)
    assert params.max_new_tokens == 4  # the default shrinks to what fits the context


def test_seeded_sampling_is_reproducible(server):
    kw = dict(input_ids=[9, 8, 7], max_new_tokens=12, temperature=1.0, top_p=0.95, top_k=40, ignore_eos=True)
    with Client(server.addr) as c:
        a = c.generate(seed=42, **kw).token_ids
        b = c.generate(seed=42, **kw).token_ids
        other = c.generate(seed=43, **kw).token_ids
    assert a == b and a != other

    async def in_a_crowd():
        async with AsyncClient(server.addr) as ac:
            noise = [ac.generate(input_ids=[i + 1] * 5, max_new_tokens=10, temperature=0.8) for i in range(6)]
            outs = await asyncio.gather(ac.generate(seed=42, **kw), *noise)
            return outs[0].token_ids

    assert asyncio.run(in_a_crowd()) == a


def test_text_streaming_and_stop_strings(server):
    with Client(server.addr) as c:
        ids = c.generate(input_ids=[5, 6, 7], max_new_tokens=10).token_ids
        full = c.generate(prompt="w5 w6 w7", max_new_tokens=10)
        assert full.token_ids == ids
        assert full.text == "".join(f" w{t}" for t in ids)
        pieces = list(c.stream(prompt="w5 w6 w7", max_new_tokens=10))
        assert "".join(p.text for p in pieces) == full.text and len(pieces) == 10
        # stop at the first occurrence of the 4th generated word; the stop string is cut out
        stop = f" w{ids[3]}"
        cut = full.text.index(stop)
        out = c.generate(prompt="w5 w6 w7", max_new_tokens=10, stop=[stop, "never"])
        assert out.finish_reason == "stop" and out.text == full.text[:cut]
        assert out.token_ids == ids[: ids.index(ids[3]) + 1]
        out = c.generate(input_ids=[5, 6, 7], max_new_tokens=10, stop_token_ids=[ids[2]])
        assert out.finish_reason == "stop" and out.token_ids == ids[: ids.index(ids[2]) + 1]


def test_health_reflection_and_admin(server):
    assert health.check(server.addr) == "SERVING"
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(server.addr) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"expertmesh.v1.Generation", "expertmesh.v1.Admin", "grpc.health.v1.Health"} <= services
        admin = admin_pb2_grpc.AdminStub(ch)
        assert list(admin.ListServers(admin_pb2.ListServersRequest()).servers) == []
        assert list(admin.GetPlacement(admin_pb2.GetPlacementRequest()).layers) == []
        load = admin.GetExpertLoad(admin_pb2.GetExpertLoadRequest())
    layers = {ll.layer: list(ll.tokens) for ll in load.layers}
    assert sorted(layers) == [0, 2]  # layer 1 of the tiny qwen3_moe is dense
    for counts in layers.values():
        assert len(counts) == 8 and sum(counts) > 0 and sum(counts) % 2 == 0  # top-2


def test_config_validation_and_sizes(model):
    from coordinator.serving.server import create_server, parse_size

    assert parse_size("256MiB") == parse_size("256M") == 256 << 20
    assert parse_size("1.5GB") == 3 << 29 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    for bad in (
        dict(dtype="int8"),
        dict(port=70000),
        dict(page_size=0),
        dict(max_running=0),
        dict(max_context=1),
    ):
        with pytest.raises(ValueError):
            config(model[0], **bad)
    with pytest.raises(ValueError, match="not even one page"):
        create_server(config(model[0], kv_memory_bytes=100))
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        create_server(config(model[0], kv_memory_bytes=1 << 16, max_context=200))
