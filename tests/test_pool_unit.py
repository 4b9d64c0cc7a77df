"""The pieces of a shared expert pool without processes: the servers' placement lease (fake
clock), the previous generation a server keeps computing after a commit, its per-expert token
counts, and the election between coordinators (coordinator/experts/pool.py) over fake servers
that hold real leases."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from coordinator.experts.cluster import ExpertCluster
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from coordinator.experts.expert_conn import ExpertServerError
from coordinator.experts.pool import PoolRole
from expertmesh import errors
from expertmesh import placement as pl
from expertmesh.experts import TorchExpertBackend, torch_moe
from expertmesh.transport import negotiate
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.worker.config import WorkerConfig
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.lease import PlacementLease
from expertmesh.worker.server import start_worker
from expertmesh.worker.slots import SlotTable
from tests import test_cluster_state as cluster_state
from tests.hf_models import make_checkpoint
from tests.test_slots import FakeReader
from tests.test_worker_core import request


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_lease_goes_to_one_holder_until_it_expires_or_is_released():
    clock = Clock()
    lease = PlacementLease(clock)
    assert lease.acquire("a", 3.0).granted
    b = lease.acquire("b", 3.0)
    assert (b.granted, b.holder) == (False, "a") and b.left_s == pytest.approx(3.0)
    assert lease.may_push("b") == "a" and lease.may_push("a") == ""
    clock.t += 2.0
    assert lease.acquire("a", 3.0).granted  # renewed: 3 s from now
    clock.t += 2.5
    assert not lease.acquire("b", 3.0).granted
    clock.t += 1.0  # a did not renew: expired
    assert lease.observe().holder == ""
    assert lease.may_push("anyone") == ""
    assert lease.acquire("b", 3.0).granted
    assert lease.release("a").holder == "b"  # not a's to release
    assert lease.release("b").holder == ""
    assert lease.acquire("a", 3.0).granted
    for bad in (0.0, -1.0, 301.0):
        with pytest.raises(ValueError):
            lease.acquire("a", bad)
    with pytest.raises(ValueError):
        lease.acquire("", 1.0)


@pytest.fixture
def worker() -> ExpertWorker:
    slots = SlotTable(FakeReader(), torch.float32, torch.device("cpu"), 4)  # type: ignore[arg-type]
    slots.preload([0, 1, 2, 3])
    return ExpertWorker(slots, TorchExpertBackend(), WorkerIdentity("cpu", "cpu", "host"))


def test_the_generation_before_the_live_one_is_computed_on_the_slots_holding_its_experts(worker):
    moe = worker.slots.moe_layers
    gen0 = {layer: (ls.w13.clone(), ls.w2.clone()) for layer, ls in worker.slots.live.layers.items()}
    worker.prepare(1, {layer: [3, 2, 1, 0] for layer in moe})
    worker.commit(1)  # NOTE: the weights are rewritten in place: gen0 holds copies
    for gen in (0, 1):  # a follower still on 0 and the holder on 1
        req = request(generation=gen)
        checked = worker.check(req)
        assert checked.generation == 1
        out = worker.compute(checked)
        w13, w2 = gen0[2] if gen == 0 else (worker.slots.live.layers[2].w13, worker.slots.live.layers[2].w2)
        assert torch.equal(out, torch_moe(req.hidden, w13, w2, req.slot_ids, req.weights))
    worker.prepare(2, {layer: [0, 1] for layer in moe})
    worker.commit(2)
    # generation 1's slots 0, 1 held experts 3, 2, gone from this server now; 2, 3 held 1, 0
    with pytest.raises(errors.StaleGeneration, match="no longer on this server"):
        worker.check(
            request(generation=1, slot_ids=torch.tensor([[0, 2], [3, -1], [2, 3]], dtype=torch.int32))
        )
    kept = request(generation=1, slot_ids=torch.tensor([[2, 3], [3, -1], [-1, 2]], dtype=torch.int32))
    assert worker.check(kept).slot_ids.tolist() == [[1, 0], [0, -1], [-1, 1]]
    with pytest.raises(errors.StaleGeneration):  # two generations back
        worker.check(request(generation=0))


def test_tokens_per_logical_expert_survive_placement_changes(worker):
    e = worker.cfg.num_experts
    want = torch.zeros(e, dtype=torch.long)
    for gen, experts in ((0, [0, 1, 2, 3]), (1, [3, 2, 1, 0])):
        if gen:
            worker.prepare(gen, {layer: experts for layer in worker.slots.moe_layers})
            worker.commit(gen)
        req = request(t=5, generation=gen)
        worker.compute(worker.check(req))
        ids = req.slot_ids.flatten()
        want += torch.bincount(torch.tensor(experts)[ids[ids >= 0].long()], minlength=e)
    assert worker.tokens_per_expert[2].tolist() == want.tolist()


def test_a_slot_holding_another_adapter_is_refused(worker):
    worker.load_adapter(0, "x", {}, "/adapters/x")
    worker.load_adapter(0, "x", {})  # the same name again (a placement change re-pushes it)
    with pytest.raises(errors.InvalidRequest, match="holds adapter 'x'"):
        worker.load_adapter(0, "y", {})
    assert worker.adapter_sources == {"x": "/adapters/x"}
    worker.unload_adapter("x")
    worker.load_adapter(0, "y", {})


# ---------------------------------------------------------------- the election


@dataclass
class Answer:
    granted: bool
    holder: str
    generation: int = 0
    adapters: list = field(default_factory=list)


class FakeServer:
    """A reachable (or not) server with a real lease on a shared fake clock."""

    def __init__(self, clock: Clock, address: str) -> None:
        self.lease, self.address, self.up = PlacementLease(clock), address, True
        self.asked: list[str] = []

    def conn(self):
        server = self

        class Conn:
            def lease(self, holder, ttl_s, timeout, release=False, observe=False):
                if not server.up:
                    raise ExpertServerError.of(errors.Unavailable("down"))
                server.asked.append(holder)
                lease = server.lease
                st = (
                    lease.observe(holder)
                    if observe
                    else lease.release(holder)
                    if release
                    else lease.acquire(holder, ttl_s)
                )
                return Answer(st.granted, st.holder)

        return Conn()


def role(servers: list[FakeServer], name: str) -> PoolRole:
    conns = [s.conn() for s in servers]
    return PoolRole(lambda: conns, lambda: [s.address for s in servers], 3.0, holder_id=name)


def test_one_coordinator_holds_the_role_and_another_takes_it_when_the_lease_expires():
    clock = Clock()
    servers = [FakeServer(clock, "127.0.0.5:1"), FakeServer(clock, "127.0.0.4:1")]
    a, b = role(servers, "a"), role(servers, "b")
    a.round()
    b.round()
    assert (a.holder, b.holder) == (True, False)
    assert a.seen_holder == b.seen_holder == "a"
    clock.t += 2.0
    a.round()  # renewed
    b.round()
    clock.t += 2.0
    b.round()
    assert not b.holder  # a renewed 2 s ago: its lease runs 1 s more
    # a dies (no more renewals): b takes the role once the leases expired
    clock.t += 1.5
    b.round()
    assert b.holder and b.seen_holder == "b"
    # a comes back (a paused process): refused, it gives the role up and follows
    a.round()
    assert not a.holder and a.seen_holder == "b"


def test_two_candidates_meet_on_the_first_server_by_address():
    clock = Clock()
    servers = [FakeServer(clock, "127.0.0.5:1"), FakeServer(clock, "127.0.0.4:1")]
    a, b = role(servers, "a"), role(servers, "b")
    servers[1].lease.acquire("b", 3.0)  # b got the first server (by address) in a race
    a.round()  # a sees b's lease and stays a follower, taking nothing
    assert not a.holder and servers[0].lease.observe().holder == ""
    b.round()  # b's own lease is no one else's: it takes the rest
    assert b.holder


def test_an_unreachable_server_counts_for_nobody():
    clock = Clock()
    servers = [FakeServer(clock, "127.0.0.4:1"), FakeServer(clock, "127.0.0.5:1")]
    a, b = role(servers, "a"), role(servers, "b")
    a.round()
    servers[1].up = False  # a lost server: the holder keeps the role on the others
    clock.t += 2.0
    a.round()
    assert a.holder
    servers[0].up = False
    a.round()  # nothing reachable: no lease renewed, no role
    assert not a.holder
    servers[0].up = servers[1].up = True
    clock.t += 4.0
    b.round()
    assert b.holder


# ---------------------------------------------------------------- two clusters on fake servers


class LeasedServer(cluster_state.FakeServer):
    def __init__(self) -> None:
        super().__init__()
        self.lease = PlacementLease()


class LeasedConn(cluster_state.FakeConn):
    """A fake server connection that also answers the pool's calls (a real lease)."""

    lease_holder = ""

    def prepare(self, generation, table, timeout):
        if self.server.lease.may_push(self.lease_holder):
            raise ExpertServerError.of(errors.StaleGeneration("another coordinator holds the lease"))
        super().prepare(generation, table, timeout)

    def lease(self, holder, ttl_s, timeout, release=False, observe=False):
        self._need_up()
        lease = self.server.lease
        st = (
            lease.observe(holder)
            if observe
            else lease.release(holder)
            if release
            else lease.acquire(holder, ttl_s)
        )
        return Answer(st.granted, st.holder, self.server.generation)

    def live_placement(self, timeout):
        self._need_up()
        return self.server.generation, {k: list(v) for k, v in self.server.table.items()}


def leased_cluster(servers: list[LeasedServer]) -> ExpertCluster:
    specs = (ServerSpec("gpu0", "fake:1", "gpu"), ServerSpec("cpu0", "fake:2", "cpu"))
    config = ClusterConfig(specs, num_gpu_experts=2, timeout_s=2.0, placement_lease_s=1.5)
    by_name = dict(zip((s.name for s in specs), servers))
    return ExpertCluster(
        cluster_state.MODEL,  # type: ignore[arg-type]
        config,
        "cpu",
        connect=lambda spec: LeasedConn(spec, by_name[spec.name]),  # type: ignore[arg-type,return-value]
        local_side=negotiate.Side("host"),
    )


def test_the_second_coordinator_adopts_the_placement_and_follows_the_holders_pushes():
    servers = [LeasedServer(), LeasedServer()]
    a, b = leased_cluster(servers), leased_cluster(servers)
    try:
        a.connect(5)
        assert a.holds_role() and a.placement.generation == 1
        pushes = [list(s.calls) for s in servers]
        b.connect(5)  # a pool that serves: adopted, nothing pushed
        assert not b.holds_role() and b.ready()
        assert [s.calls for s in servers] == pushes
        assert b.placement.layers == a.placement.layers and b.placement.generation == 1
        with pytest.raises(ExpertServerError, match="holds the placement role"):
            b.update_placement(a.placement.with_generation(2), 2.0)
        # the holder moves expert 1 of every layer to the CPU server; the follower adopts it
        lists = {layer: {"gpu0": [0], "cpu0": [1, 2, 3]} for layer in (0, 1)}
        new = pl.from_server_lists(2, ("gpu0", "cpu0"), 4, lists)
        assert a.update_placement(new, 2.0) == []
        b.pool.round()  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while b.placement.generation != 2:
            assert time.monotonic() < deadline, "the follower never adopted generation 2"
            time.sleep(0.02)
        assert b.placement.layers == new.layers
        # the holder stops: it gives the role back, the follower takes it at its next round
        a.close()
        b.pool.round()  # type: ignore[union-attr]
        assert b.holds_role()
        assert b.update_placement(pl.from_server_lists(3, ("gpu0", "cpu0"), 4, lists), 2.0) == []
        assert [s.generation for s in servers] == [3, 3]
    finally:
        a.close()
        b.close()


def test_an_expert_server_grants_its_lease_to_one_coordinator_and_fences_pushes(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    P = pb.ApplyPlacementRequest

    async def main() -> None:
        w = await start_worker(
            WorkerConfig("cpu", str(tmp_path), port=0, experts="none"), TorchExpertBackend()
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{w.port}") as ch:
                stub = pb_grpc.ExpertWorkerStub(ch)
                moe = list((await stub.Describe(pb.DescribeRequest())).moe_layers)
                table = [pb.LayerSlots(layer=layer, experts=[1, 0]) for layer in moe]
                lease = stub.PlacementLease
                assert (await lease(pb.PlacementLeaseRequest(holder="a", ttl_ms=5000))).granted
                got = await lease(pb.PlacementLeaseRequest(holder="b", ttl_ms=5000))
                assert (got.granted, got.holder) == (False, "a") and 0 < got.ttl_left_ms <= 5000
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.ApplyPlacement(
                        P(phase=P.PREPARE, generation=1, layers=table, lease_holder="b")
                    )
                assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "'a'" in ei.value.details()
                await stub.ApplyPlacement(P(phase=P.PREPARE, generation=1, layers=table, lease_holder="a"))
                await stub.ApplyPlacement(P(phase=P.COMMIT, generation=1, lease_holder="a"))
                live = await stub.LivePlacement(pb.LivePlacementRequest())
                assert live.generation == 1 and {ls.layer: list(ls.experts) for ls in live.layers} == {
                    layer: [1, 0] for layer in moe
                }
                seen = await lease(pb.PlacementLeaseRequest(holder="b", observe=True))
                assert (seen.granted, seen.holder, seen.generation) == (False, "a", 1)
                await lease(pb.PlacementLeaseRequest(holder="a", release=True))
                assert (await lease(pb.PlacementLeaseRequest(holder="b", ttl_ms=5000))).granted
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await lease(pb.PlacementLeaseRequest(holder="c", ttl_ms=0))
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await w.stop(0)

    asyncio.run(main())


# ---------------------------------------------------------------- cross-stream batching


def test_waiting_requests_of_several_streams_are_computed_together_and_a_bad_one_fails_alone():
    slots = SlotTable(FakeReader(), torch.float32, torch.device("cpu"), 4)  # type: ignore[arg-type]
    slots.preload([0, 1, 2, 3])
    worker = ExpertWorker(slots, TorchExpertBackend(), WorkerIdentity("cpu", "cpu", "host"), combine=True)
    # the second names slots this server does not have
    reqs = [request(t=3), request(t=4, slot_ids=torch.full((4, 2), 7, dtype=torch.int32)), request(t=5)]
    outs = [torch.full(r.hidden.shape, float("nan")) for r in reqs]
    errs: list[BaseException | None] = [None] * 3
    combiner = worker.combiner
    assert combiner is not None

    def run(i: int) -> None:
        try:
            worker.forward_into(reqs[i], outs[i])
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            errs[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    with worker._serial:  # the server is busy: all three wait
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(combiner._waiting) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    for t in threads:
        t.join(10)
    assert isinstance(errs[1], errors.InvalidRequest) and errs[0] is None and errs[2] is None
    w = worker.slots.live.layers[2]
    for i in (0, 2):
        r = reqs[i]
        want = torch_moe(r.hidden, w.w13, w.w2, r.slot_ids, r.weights)
        torch.testing.assert_close(outs[i], want)
    assert (combiner.batches, combiner.combined) == (1, 2)
    assert (worker.stats.requests, worker.stats.tokens, worker.stats.errors) == (1, 8, 1)
