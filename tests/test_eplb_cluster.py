"""EPLB across processes: the demo model on a coordinator (in this process) + two CPU expert
servers over loopback gRPC.

- ``load_aware`` sends a replicated expert's tokens to both of its replicas;
- periodic rebalancing every few steps under concurrent load: no request fails and the greedy
  outputs equal those of a run without rebalancing;
- ``expertmesh placement rebalance --dry-run`` prints the plan;
- a server killed before PREPARE leaves the old placement live, and serving resumes on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import grpc
import pytest

from coordinator.eplb.plan import EplbConfig
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from coordinator.serving.server import CoordinatorConfig
from expertmesh import cli
from expertmesh.client import AsyncClient
from expertmesh.demo import write_demo_model
from expertmesh.v1 import admin_pb2, admin_pb2_grpc, expert_worker_pb2, expert_worker_pb2_grpc
from tests.cluster_utils import start_server
from tests.serving_utils import ServerThread, one_thread  # noqa: F401 (autouse fixture)
from tests.test_serving_cluster import wait_health

pytestmark = pytest.mark.slow

PROMPTS = ["the cat sat on the", "once upon a time", "a small model", "expert servers"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = write_demo_model(tmp_path_factory.mktemp("demo") / "model")
    procs = [start_server("cpu", path, 0, "--threads", "1"), start_server("cpu", path, 0, "--threads", "1")]
    try:
        yield path, procs
    finally:
        for p in procs:  # NOTE: whatever runs now: a test may have restarted one in its place
            p.stop()


def coordinator(path, procs, transport: str = "auto", **eplb) -> ServerThread:
    specs = tuple(ServerSpec(f"cpu{i}", p.address, "cpu") for i, p in enumerate(procs))
    return ServerThread(
        CoordinatorConfig(
            model_dir=str(path),
            port=0,
            max_batch_tokens=64,
            max_running=16,
            connect_timeout_s=5.0,
            cluster=ClusterConfig(specs, replica_policy="load_aware", timeout_s=10.0, transport=transport),
            eplb=EplbConfig(**eplb),
        )
    )


async def generate_all(addr: str, rounds: int = 1, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    async with AsyncClient(addr) as client:

        async def one(prompt: str) -> list[int]:
            out = await client.generate(prompt, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            return out.token_ids

        outs: list[list[int]] = []
        for _ in range(rounds):
            outs += await asyncio.gather(*(one(p) for p in PROMPTS))
        return outs


def admin(addr: str) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(grpc.insecure_channel(addr))


def slot_tokens(address: str, layer: int) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        stats = expert_worker_pb2_grpc.ExpertWorkerStub(ch).Stats(expert_worker_pb2.StatsRequest())
    return next(list(x.tokens_per_slot) for x in stats.layers if x.layer == layer)


def test_eplb_cluster(servers):
    path, procs = servers
    # 1. no rebalancing: the reference outputs; load_aware over a replicated expert
    with coordinator(path, procs, interval_steps=0) as s:
        wait_health(s.addr, "SERVING")
        reference = asyncio.run(generate_all(s.addr))
        load = admin(s.addr).GetExpertLoad(admin_pb2.GetExpertLoadRequest())
        hot = max(range(16), key=lambda e: load.layers[0].window_tokens[e])
        layer = load.layers[0].layer
        lists = {"cpu0": list(range(8)), "cpu1": list(range(8, 16))}
        lists["cpu0" if hot >= 8 else "cpu1"].append(hot)  # the hottest expert on both servers
        # bad placements are refused with INVALID_ARGUMENT and change nothing: malformed, an
        # unknown expert, more slots than a server holds (16 per layer by default)
        over = {"cpu0": [*range(16), 3], "cpu1": list(range(16))}
        for bad in (
            "{not json",
            json.dumps({"layers": {"*": {"cpu0": [0], "cpu1": [99]}}}),
            json.dumps({"servers": ["cpu0", "cpu1"], "layers": {"*": over}}),
        ):
            with pytest.raises(grpc.RpcError) as err:
                admin(s.addr).SetPlacement(admin_pb2.SetPlacementRequest(placement_json=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "holds at most 16 slots" in err.value.details()
        assert admin(s.addr).GetPlacement(admin_pb2.GetPlacementRequest()).generation == 1
        listed = admin(s.addr).ListServers(admin_pb2.ListServersRequest()).servers
        assert [x.state for x in listed] == ["ready", "ready"]  # a refused placement downs no server
        text = json.dumps({"servers": ["cpu0", "cpu1"], "layers": {"*": lists}})
        admin(s.addr).SetPlacement(admin_pb2.SetPlacementRequest(placement_json=text))
        before = [slot_tokens(p.address, layer) for p in procs]
        # NOTE: enough decode steps that the hot expert's tokens outweigh the other experts'
        # imbalance between the servers in some of them (then both replicas get tokens)
        asyncio.run(generate_all(s.addr, rounds=2, new_tokens=16))
        after = [slot_tokens(p.address, layer) for p in procs]
        slot = [lists["cpu0"].index(hot), lists["cpu1"].index(hot)]
        # a server restarts its per-slot counts when its slot count changes
        before = [b if len(b) == len(a) else [0] * len(a) for a, b in zip(after, before)]
        got = [after[i][slot[i]] - before[i][slot[i]] for i in range(2)]
        assert got[0] > 0 and got[1] > 0, f"expert {hot}'s tokens per replica: {got}"
        # the fast path (this transport's default on loopback) carries each server's own
        # compute time too: EPLB's speeds, without which it took every server as equally fast
        speeds = admin(s.addr).GetExpertLoad(admin_pb2.GetExpertLoadRequest()).servers
        assert all(x.compute_ms > 0 and x.computed_tokens > 0 for x in speeds), speeds

    # 2. rebalancing every 3 steps under concurrent load (over gRPC, whose answers carry the
    # servers' compute times: the recorder's speeds)
    eplb = dict(interval_steps=3, window_steps=16, redundant_slots=2, skip_threshold=0.0)
    with coordinator(path, procs, "grpc", **eplb) as s:
        wait_health(s.addr, "SERVING")
        outs = asyncio.run(generate_all(s.addr, rounds=2))
        assert s.server is not None and s.server.eplb is not None
        s.server.eplb.wait_idle()  # the last periodic run may still be pushing
        assert outs == reference * 2
        st = admin(s.addr).GetEplbStatus(admin_pb2.GetEplbStatusRequest())
        assert st.rebalanced >= 1 and st.failed == 0, st
        load = admin(s.addr).GetExpertLoad(admin_pb2.GetExpertLoadRequest())
        assert [x.name for x in load.servers] == ["cpu0", "cpu1"]
        assert all(x.compute_ms > 0 and x.computed_tokens > 0 for x in load.servers), load.servers
        generation = admin(s.addr).GetPlacement(admin_pb2.GetPlacementRequest()).generation

        # 3. the CLI's dry run prints the plan and pushes nothing
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli.main(["placement", "rebalance", "--dry-run", "--addr", s.addr])
        text = buf.getvalue()
        assert rc == 0 and text.startswith("dry-run") and "plan:" in text and "layer" in text, text
        assert admin(s.addr).GetPlacement(admin_pb2.GetPlacementRequest()).generation == generation

        # 4. a server killed before PREPARE: the rebalance fails, the old placement stays live
        port = procs[1].port
        procs[1].kill()
        out = admin(s.addr).Rebalance(admin_pb2.RebalanceRequest()).outcome
        assert out.outcome == "failed", out
        assert admin(s.addr).GetPlacement(admin_pb2.GetPlacementRequest()).generation == generation
        procs[1] = start_server("cpu", path, port, "--threads", "1")
        wait_health(s.addr, "SERVING")
        assert asyncio.run(generate_all(s.addr))[: len(PROMPTS)] == reference
        assert admin(s.addr).GetPlacement(admin_pb2.GetPlacementRequest()).generation >= generation
