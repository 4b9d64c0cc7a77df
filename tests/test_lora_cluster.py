"""MoE LoRA across three processes: coordinator (in this process) + a GPU expert server (on the
CPU) + a CPU expert server, experts split between them.

An adapter hot-loaded with ``expertmesh lora load`` (PEFT adapter on attention, the shared expert
and the fused routed experts) gives PEFT's greedy tokens and log-probabilities; base requests
running beside adapter requests keep the base model's; bad loads get clear statuses and leave
nothing behind; a server that refuses the push leaves the adapter unusable, the status naming
that server."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import grpc
import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.serving.server import CoordinatorConfig
from expertmesh.cli import main as cli
from expertmesh.client import AsyncClient, Client
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests import lora_utils
from tests.cluster_utils import start_server
from tests.serving_utils import (
    ServerThread,
    hf_greedy,
    one_thread,  # noqa: F401 (autouse fixture)
)
from tests.test_serving_cluster import wait_health

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 7], [11, 60, 3, 3, 8, 21, 90]]
STEPS = 10


@pytest.fixture(scope="module")
def lora_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cluster")
    hf = lora_utils.make_model("qwen2_moe", root / "model")
    with torch.no_grad():
        base_refs = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    pm = lora_utils.wrap(hf, seed=3)
    adapters = root / "adapters"
    lora_utils.save(pm, adapters / "a")
    with torch.no_grad():
        lora_refs = [hf_greedy(pm, p, STEPS) for p in PROMPTS]
    gpu, cpu = start_server("gpu", root / "model"), start_server("cpu", root / "model")
    servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
    config = CoordinatorConfig(
        model_dir=str(root / "model"),
        port=0,
        page_size=4,
        max_batch_tokens=32,
        connect_timeout_s=2.0,
        cluster=ClusterConfig(servers, num_gpu_experts=3, timeout_s=10.0),
        lora_dirs=(str(adapters),),
        max_loras=2,
    )
    try:
        with ServerThread(config) as s:
            wait_health(s.addr, "SERVING")
            yield root, s, base_refs, lora_refs, cpu
    finally:
        gpu.stop()
        cpu.stop()


def _admin(addr: str):
    ch = grpc.insecure_channel(addr)
    return ch, admin_pb2_grpc.AdminStub(ch)


def _check(result, ref) -> None:
    toks, lsm = ref
    assert result.token_ids == toks
    want = lsm.gather(1, torch.tensor(toks)[:, None]).squeeze(1)
    assert (torch.tensor(result.logprobs) - want).abs().max().item() < 1e-4


def test_hot_loaded_adapter_matches_peft_beside_base(lora_cluster, capsys):
    root, s, base_refs, lora_refs, _ = lora_cluster
    assert cli(["lora", "load", "a", str(root / "adapters" / "a"), "--addr", s.addr]) == 0
    assert "loaded a\tslot=0" in capsys.readouterr().out
    assert cli(["lora", "list", "--addr", s.addr, "--json"]) == 0
    listed = capsys.readouterr().out
    assert '"name": "a"' in listed and '"expert_layers": [0, 1, 2]' in listed

    async def both() -> list:
        async with AsyncClient(s.addr) as c:
            jobs = []
            for p in PROMPTS:  # every prompt with and without the adapter, all at once
                for lora in ("", "a"):
                    kw = dict(max_new_tokens=STEPS, logprobs=True, ignore_eos=True, lora=lora)
                    jobs.append(c.generate(input_ids=p, **kw))
            return await asyncio.gather(*jobs)

    results = asyncio.run(both())
    for i in range(len(PROMPTS)):
        _check(results[2 * i], base_refs[i])
        _check(results[2 * i + 1], lora_refs[i])
    ids = ",".join(map(str, PROMPTS[2]))
    argv = [
        "generate",
        "--addr",
        s.addr,
        "--input-ids",
        ids,
        "--max-new-tokens",
        "4",
        "--json",
        "--ignore-eos",
        "--lora",
        "a",
    ]
    assert cli(argv) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == lora_refs[2][0][:4]
    assert base_refs[0][0] != lora_refs[0][0] or base_refs[2][0] != lora_refs[2][0]


def test_an_adapter_the_servers_refuse_fails_only_its_own_requests(lora_cluster, capsys):
    """An adapter whose (finite) weights overflow the hidden states: every layer its rows reach
    is refused by the expert servers, yet base requests of the same steps get the base model's
    tokens and log-probabilities; NaN in an adapter is refused at load, naming the tensor."""
    from safetensors.torch import load_file, save_file

    root, s, base_refs, _, _ = lora_cluster
    src = root / "adapters" / "a"
    for name, value in (("huge", 3e38), ("nan", float("nan"))):
        dst = root / "adapters" / name
        shutil.copytree(src, dst)
        t = load_file(dst / "adapter_model.safetensors")
        key = next(k for k in t if "0.self_attn.o_proj.lora_B" in k)
        t[key] = torch.full_like(t[key], value)
        save_file(t, dst / "adapter_model.safetensors")
    assert cli(["lora", "load", "nan", str(root / "adapters" / "nan"), "--addr", s.addr]) != 0
    assert "0.self_attn.o_proj.lora_B" in capsys.readouterr().err
    assert cli(["lora", "load", "huge", str(root / "adapters" / "huge"), "--addr", s.addr]) == 0

    async def mixed() -> list:
        async with AsyncClient(s.addr) as c:
            kw = dict(max_new_tokens=STEPS, logprobs=True, ignore_eos=True)
            jobs = [c.generate(input_ids=p, **kw) for p in PROMPTS]
            jobs.insert(1, c.generate(input_ids=PROMPTS[1], lora="huge", **kw))
            return await asyncio.gather(*jobs, return_exceptions=True)

    try:
        results = asyncio.run(mixed())
        bad = results.pop(1)
        assert isinstance(bad, grpc.RpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        for r, ref in zip(results, base_refs):
            assert not isinstance(r, BaseException), r
            _check(r, ref)
    finally:
        assert cli(["lora", "unload", "huge", "--addr", s.addr]) == 0


def test_adapter_follows_a_placement_change(lora_cluster):
    """Experts moved and replicated across servers by a new placement keep the adapter's LoRA:
    each server gets the LoRA of its new experts in the same PREPARE."""
    from expertmesh import placement as pl

    _, s, base_refs, lora_refs, _ = lora_cluster
    cluster = s.server.cluster
    old = cluster.placement
    # the GPU server takes 4..7 and a replica of 0; the CPU server 0..3 (it had 3..7)
    lists = {"gpu0": [4, 5, 6, 7, 0], "cpu0": [0, 1, 2, 3]}
    new = pl.from_server_lists(old.generation + 1, old.servers, 8, {layer: lists for layer in (0, 1, 2)})
    assert cluster.update_placement(new, 10.0, s.scheduler.call_between_steps) == []
    with Client(s.addr) as c:
        kw = dict(max_new_tokens=STEPS, logprobs=True, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            _check(c.generate(input_ids=p, lora="a", **kw), lora_refs[i])
            _check(c.generate(input_ids=p, **kw), base_refs[i])


def test_bad_loads_get_clear_statuses(lora_cluster, tmp_path):
    root, s, _, _, _ = lora_cluster
    ch, admin = _admin(s.addr)
    outside = tmp_path / "outside"
    shutil.copytree(root / "adapters" / "a", outside)
    bad = root / "adapters" / "bad_rank"
    shutil.copytree(root / "adapters" / "a", bad, dirs_exist_ok=True)
    cfg = (bad / "adapter_config.json").read_text().replace('"r": 4', '"r": 5')
    (bad / "adapter_config.json").write_text(cfg)
    cases = [
        (admin_pb2.LoadLoRARequest(name="x", path=str(outside)), grpc.StatusCode.PERMISSION_DENIED, "--lora-dir"),
        (admin_pb2.LoadLoRARequest(name="x", path=str(bad)), grpc.StatusCode.INVALID_ARGUMENT, "r=5"),
        (admin_pb2.LoadLoRARequest(name="x", path=str(root / "adapters" / "nope")), grpc.StatusCode.INVALID_ARGUMENT, "not a directory"),
    ]  # fmt: skip
    with ch:
        before = list(admin.ListLoRA(admin_pb2.ListLoRARequest()).adapters)
        for req, code, words in cases:
            with pytest.raises(grpc.RpcError) as e:
                admin.LoadLoRA(req)
            assert e.value.code() == code and words in e.value.details(), e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            admin.UnloadLoRA(admin_pb2.UnloadLoRARequest(name="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert list(admin.ListLoRA(admin_pb2.ListLoRARequest()).adapters) == before
    with Client(s.addr) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(input_ids=[1, 2], lora="x")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown adapter" in e.value.details()


def test_hot_load_use_unload_while_32_requests_stream(lora_cluster):
    root, s, base_refs, lora_refs, _ = lora_cluster
    path = str(root / "adapters" / "a")

    async def run():
        async with AsyncClient(s.addr) as c:
            kw = dict(max_new_tokens=STEPS, logprobs=True, ignore_eos=True)
            streams = [asyncio.ensure_future(c.generate(input_ids=PROMPTS[i % 3], **kw)) for i in range(32)]
            await asyncio.sleep(0.05)
            loaded = await asyncio.to_thread(cli, ["lora", "load", "b", path, "--addr", s.addr])
            used = await c.generate(input_ids=PROMPTS[2], lora="b", **kw)
            unloaded = await asyncio.to_thread(cli, ["lora", "unload", "b", "--addr", s.addr])
            return loaded, used, unloaded, await asyncio.gather(*streams)

    loaded, used, unloaded, base = asyncio.run(run())
    assert loaded == 0 and unloaded == 0
    _check(used, lora_refs[2])
    for i, r in enumerate(base):  # 0 failed, outputs unchanged
        _check(r, base_refs[i % 3])


def test_unload_then_load_while_a_server_is_down(lora_cluster):
    root, s, base_refs, _, cpu = lora_cluster
    assert cli(["lora", "unload", "a", "--addr", s.addr]) == 0
    with Client(s.addr) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(input_ids=PROMPTS[0], lora="a")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        _check(
            c.generate(input_ids=PROMPTS[0], max_new_tokens=STEPS, logprobs=True, ignore_eos=True),
            base_refs[0],
        )
    # a server that is down takes no push: the adapter loads on the live ones and reaches the
    # other when it rejoins (tests/test_fault_tolerance.py); a push that a LIVE server refuses
    # is all or nothing (ExpertCluster.two_phase, tests/test_cluster_state.py)
    cpu.kill()
    ch, admin = _admin(s.addr)
    with ch:
        deadline = time.monotonic() + 30
        while {x.name: x.state for x in admin.ListServers(admin_pb2.ListServersRequest()).servers}[
            "cpu0"
        ] == "ready":
            assert time.monotonic() < deadline, "the coordinator never saw cpu0 go down"
            time.sleep(0.1)
        assert cli(["lora", "load", "a", str(root / "adapters" / "a"), "--addr", s.addr]) == 0
        assert [a.name for a in admin.ListLoRA(admin_pb2.ListLoRARequest()).adapters] == ["a"]
