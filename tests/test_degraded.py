"""Degraded placement (``--degraded-replace-after``): with no replicas, a server that
stays down has its experts re-placed over the other servers (EPLB) from the checkpoint, so the
requests that needed them succeed again with the reference tokens; when it comes back, the
placement from before is restored."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from coordinator.eplb.degraded import degraded_placement
from expertmesh import placement as pl
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests.cluster_utils import start_server
from tests.fault_utils import Job, run_load, start_coordinator, wait_health, wait_states
from tests.hf_models import make_checkpoint

PROMPTS = [tuple((11 * i + j * 5) % 90 + 2 for j in range(3 + i % 3)) for i in range(6)]


def test_degraded_placement_covers_every_expert_on_the_servers_left():
    layers = [0, 2, 3]
    live = pl.static_split(layers, 8, ["gpu0", "gpu1"], ["cpu0"], 6)  # cpu0 holds 6 and 7 alone
    for cap, down in (([8, 8, 8], {2}), ([4, 4, 8], {2}), ([8, 8, 8], {0}), ([8, 8, 8], {0, 2})):
        new = degraded_placement(live, layers, frozenset(down), torch.tensor(cap))
        new.validate()
        assert new.generation == live.generation + 1
        for layer in layers:
            lp = new.layers[layer]
            assert sorted(set(lp.phy2log)) == list(range(8)), (cap, down, lp)
            assert not set(lp.owner) & down
            for s, c in enumerate(cap):
                assert lp.owner.count(s) <= c
            # experts that stay on a live server are not moved off it
            old = live.layers[layer]
            kept = {(e, o) for e, o in zip(old.phy2log, old.owner) if o not in down}
            assert (
                len(kept & set(zip(lp.phy2log, lp.owner)))
                >= min(len(kept), 8 - sum(cap[i] for i in down)) - 2
            )
    with pytest.raises(ValueError, match="fewer than the 8 experts"):
        degraded_placement(live, layers, frozenset({2}), torch.tensor([3, 4, 8]))


def placement_of(addr: str) -> tuple[int, dict[str, set[int]]]:
    """Generation and, per server, the experts it holds in the first MoE layer."""
    with grpc.insecure_channel(addr) as ch:
        p = admin_pb2_grpc.AdminStub(ch).GetPlacement(admin_pb2.GetPlacementRequest(), timeout=10)
    names = list(p.servers)
    lp = p.layers[0]
    held: dict[str, set[int]] = {n: set() for n in names}
    for e, o in zip(lp.phy2log, lp.owner):
        held[names[o]].add(e)
    return p.generation, held


@pytest.mark.slow
def test_a_lost_server_is_replaced_then_restored(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    gpu, cpu = start_server("gpu", tmp_path), start_server("cpu", tmp_path)
    co = start_coordinator(
        tmp_path, "--gpu-server", gpu.address, "--cpu-server", cpu.address, "--num-gpu-experts", "4",
        "--expert-timeout", "3", "--connect-timeout", "2", "--kv-memory", "8MiB",
        "--degraded-replace-after", "1",
    )  # fmt: skip
    jobs = [[Job(q, 5)] for q in PROMPTS]
    try:
        wait_health(co.addr, "SERVING")
        want = run_load(co.addr, jobs)
        assert all(o.error is None for [o] in want)
        gen0, held0 = placement_of(co.addr)
        assert held0 == {"gpu0": {0, 1, 2, 3}, "cpu0": {4, 5, 6, 7}}
        cpu.kill()
        t0 = time.monotonic()
        wait_health(co.addr, "NOT_SERVING", timeout=10)
        # after the delay every expert is on gpu0 (loaded from the checkpoint): covered again
        took = wait_health(co.addr, "SERVING", timeout=30)
        gen1, held1 = placement_of(co.addr)
        assert gen1 > gen0 and held1 == {"gpu0": set(range(8)), "cpu0": set()}, held1
        assert time.monotonic() - t0 >= 1.0, took
        got = run_load(co.addr, jobs)
        assert [o.tokens for [o] in got] == [o.tokens for [o] in want], [o.error for [o] in got]
        # back on its port: it rejoins and the placement from before is restored
        cpu = start_server("cpu", tmp_path, cpu.port)
        deadline = time.monotonic() + 30
        while placement_of(co.addr)[1] != held0:
            assert time.monotonic() < deadline, placement_of(co.addr)
            time.sleep(0.1)
        wait_states(co.addr, {"gpu0": "ready", "cpu0": "ready"})
        assert placement_of(co.addr)[0] > gen1
        got = run_load(co.addr, jobs)
        assert [o.tokens for [o] in got] == [o.tokens for [o] in want], [o.error for [o] in got]
    finally:
        co.stop()
        gpu.stop()
        cpu.stop()
