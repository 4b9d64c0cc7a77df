"""The expert cluster's state machine with fake connections (no processes, no gRPC): first
bring-up with the two-phase placement push, a server going down and coming back (the live
placement re-pushed only when it lacks it), incompatible servers, and the generic two-phase
broadcast with a failing member."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from coordinator.experts.cluster import ExpertCluster, ServerState
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from coordinator.experts.expert_conn import ExpertServerError
from expertmesh import errors
from expertmesh import placement as pl
from expertmesh.transport import negotiate
from expertmesh.worker_api import WorkerInfo

MODEL = SimpleNamespace(model_type="qwen3_moe", hidden_size=8, num_experts=4, moe_layer_ids=[0, 1])


class FakeServer:
    def __init__(self, generation: int = 0, capacity: int = 4, hidden: int = 8) -> None:
        self.up, self.generation, self.capacity, self.hidden = True, generation, capacity, hidden
        self.staged: tuple[int, dict] | None = None
        self.table: dict[int, list[int]] = {}
        self.fail: set[str] = set()  # phases that fail: "prepare", "commit"
        self.calls: list[tuple[str, int]] = []


class FakeConn:
    def __init__(self, spec: ServerSpec, server: FakeServer) -> None:
        self.spec, self.server = spec, server
        self.info: WorkerInfo | None = None
        self.on_down = lambda err: None
        self.stream = False
        self.closed = False

    def _need_up(self) -> None:
        if not self.server.up:
            raise ExpertServerError.of(errors.Unavailable(f"{self.spec.name}: connection refused"))

    def describe(self, timeout: float) -> WorkerInfo:
        self._need_up()
        s = self.server
        self.info = WorkerInfo(
            self.spec.kind, "cpu", torch.float32, "torch", "qwen3_moe", s.hidden, 4, (0, 1),
            s.capacity, "host", (), s.generation,
        )  # fmt: skip
        return self.info

    def plan_transport(self, info: WorkerInfo, local: negotiate.Side) -> None:
        pass

    def wait_serving(self, deadline: float) -> None:
        self._need_up()

    def prepare(self, generation: int, table: dict[int, list[int]], timeout: float) -> None:
        self._need_up()
        self.server.calls.append(("prepare", generation))
        if "prepare" in self.server.fail:
            raise ExpertServerError.of(errors.InvalidRequest(f"{self.spec.name}: cannot load"))
        self.server.staged = (generation, table)

    def commit(self, generation: int, timeout: float) -> None:
        self._need_up()
        s = self.server
        s.calls.append(("commit", generation))
        if "commit" in s.fail or s.staged is None or s.staged[0] != generation:
            raise ExpertServerError.of(errors.StaleGeneration(f"{self.spec.name}: nothing prepared"))
        s.generation, s.table, s.staged = generation, s.staged[1], None

    def abort(self, generation: int, timeout: float) -> None:
        self.server.calls.append(("abort", generation))
        self.server.staged = None

    def open_stream(self) -> None:
        self._need_up()
        self.stream = True

    def stream_alive(self) -> bool:
        return self.stream and self.server.up

    def reset(self, reason: str) -> None:
        self.stream = False

    def close(self) -> None:
        self.closed = True

    def die(self) -> None:
        """The process is killed: its stream's reader tells the cluster."""
        self.server.up, self.stream = False, False
        self.on_down(ExpertServerError.of(errors.Unavailable(f"{self.spec.name}: stream closed")))


def make(*servers: FakeServer, **kw) -> tuple[ExpertCluster, list[FakeConn]]:
    specs = (ServerSpec("gpu0", "fake:1", "gpu"), ServerSpec("cpu0", "fake:2", "cpu"))[: len(servers)]
    config = ClusterConfig(specs, num_gpu_experts=2 if len(specs) == 2 else 4, timeout_s=2.0, **kw)
    by_name = dict(zip((s.name for s in specs), servers))
    conns: list[FakeConn] = []

    def connect(spec: ServerSpec) -> FakeConn:
        conns.append(FakeConn(spec, by_name[spec.name]))
        return conns[-1]

    cluster = ExpertCluster(MODEL, config, "cpu", connect=connect, local_side=negotiate.Side("host"))  # type: ignore[arg-type]
    return cluster, conns


def test_first_bring_up_pushes_a_newer_generation_to_all():
    gpu, cpu = FakeServer(generation=3), FakeServer()
    c, conns = make(gpu, cpu)
    assert [m.state for m in c.members] == [ServerState.CONNECTING] * 2 and not c.ready()
    try:
        c.connect(5)
        assert c.ready() and c.placement.generation == 4  # newer than any server's
        for s in (gpu, cpu):
            assert s.calls == [("prepare", 4), ("commit", 4)] and s.generation == 4
        assert gpu.table == {0: [0, 1], 1: [0, 1]} and cpu.table == {0: [2, 3], 1: [2, 3]}
        assert all(conn.stream for conn in conns)
        assert [i["state"] for i in c.server_infos()] == ["ready", "ready"]
        c.ensure_ready(0.1)  # nothing to wait for
    finally:
        c.close()
    assert all(conn.closed for conn in conns)


def test_a_failed_prepare_aborts_the_prepared_and_commits_nothing():
    gpu, cpu = FakeServer(), FakeServer()
    cpu.fail.add("prepare")
    c, _ = make(gpu, cpu)
    with pytest.raises(ExpertServerError) as ei:
        c.connect(5)
    assert isinstance(ei.value.error, errors.InvalidRequest) and "cpu0" in str(ei.value)
    assert gpu.calls == [("prepare", 1), ("abort", 1)] and gpu.generation == 0
    assert cpu.calls == [("prepare", 1), ("abort", 1)]  # the failed one too: a timed-out one may still load
    assert c.members[1].state is ServerState.UNAVAILABLE and "cannot load" in c.members[1].last_error
    assert not c.ready()
    c.close()


@pytest.mark.parametrize(
    "server, words",
    [(FakeServer(hidden=16), "serves a different model"), (FakeServer(capacity=1), "holds at most 1 slots")],
)
def test_an_incompatible_server_is_refused_with_failed_precondition(server, words):
    c, _ = make(FakeServer(), server)
    with pytest.raises(ExpertServerError) as ei:
        c.connect(5)
    assert isinstance(ei.value.error, errors.Incompatible) and words in str(ei.value)
    assert ei.value.error.status == errors.FAILED_PRECONDITION
    c.close()


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_down_then_restarted_server_is_brought_back_with_the_live_placement():
    gpu, cpu = FakeServer(), FakeServer()
    c, conns = make(gpu, cpu)
    try:
        c.connect(5)
        live = c.placement.generation
        conns[1].die()
        assert c.members[1].state is ServerState.UNAVAILABLE and not c.ready()
        t0 = time.monotonic()
        with pytest.raises(ExpertServerError) as ei:
            c.ensure_ready(0.3)
        assert isinstance(ei.value.error, errors.Unavailable) and "cpu0" in str(ei.value)
        assert time.monotonic() - t0 < 2.0
        # restarted: a fresh process at generation 0; the cluster's thread re-pushes (two phases)
        cpu.generation, cpu.calls, cpu.table = 0, [], {}
        cpu.up = True
        c.ensure_ready(5)
        assert c.ready() and cpu.calls == [("prepare", live), ("commit", live)]
        assert cpu.table == gpu.table | {0: [2, 3], 1: [2, 3]} and conns[1].stream
        assert gpu.calls == [("prepare", live), ("commit", live)]  # the live server is left alone
        # a stream that died while the server kept its placement: reopened, nothing re-pushed
        conns[1].stream = False
        wait_for(lambda: conns[1].stream)
        assert cpu.calls == [("prepare", live), ("commit", live)] and c.ready()
    finally:
        c.close()


def test_maintenance_thread_does_the_first_bring_up_when_started():
    gpu, cpu = FakeServer(), FakeServer()
    cpu.up = False
    c, _ = make(gpu, cpu)
    try:
        c.start(connect_timeout_s=0.3)
        time.sleep(0.5)
        assert not c.ready() and c.members[1].state is ServerState.UNAVAILABLE
        cpu.up = True
        wait_for(c.ready)
        assert cpu.generation == gpu.generation == c.placement.generation
    finally:
        c.close()


def test_two_phase_with_a_failing_member():
    c, _ = make(FakeServer(), FakeServer())
    seen: list[tuple[str, int]] = []

    def step(name: str, fails: int | None):
        def fn(i: int) -> None:
            seen.append((name, i))
            if i == fails:
                raise ExpertServerError.of(errors.Unavailable(f"member {i} failed {name}"))

        return fn

    with pytest.raises(ExpertServerError, match="member 1 failed prepare"):
        c.two_phase(step("prepare", 1), step("commit", None), step("abort", None))
    assert seen == [("prepare", 0), ("prepare", 1), ("abort", 0), ("abort", 1)]  # nothing committed
    seen.clear()
    failed = c.two_phase(step("prepare", None), step("commit", 0), step("abort", None))
    # (the commits run at once: in either order)
    assert failed == [0] and seen[:2] == [("prepare", 0), ("prepare", 1)]
    assert sorted(seen[2:]) == [("commit", 0), ("commit", 1)]
    assert (
        c.members[0].state is ServerState.UNAVAILABLE and "member 0 failed commit" in c.members[0].last_error
    )
    c.close()


def test_update_placement_prepares_off_step_and_swaps_between_steps():
    gpu, cpu = FakeServer(), FakeServer()
    c, _ = make(gpu, cpu)
    try:
        c.connect(5)
        old = c.placement
        new = pl.from_server_lists(
            old.generation + 1,
            old.servers,
            4,
            {0: {"gpu0": [3, 0], "cpu0": [1, 2]}, 1: {"gpu0": [0, 1], "cpu0": [2, 3]}},
        )
        swaps: list[int] = []

        def between_steps(fn) -> Future:
            swaps.append(c.tables.generation)  # still the old one while everything is prepared
            assert gpu.staged is not None and cpu.staged is not None
            f: Future = Future()
            f.set_result(fn())
            return f

        c.between_steps = between_steps
        assert c.update_placement(new, 1.0) == []
        assert swaps == [old.generation] and c.tables.generation == new.generation
        assert gpu.table[0] == [3, 0] and cpu.table[0] == [1, 2] and gpu.generation == new.generation
        with pytest.raises(ValueError, match="cannot replace"):
            c.update_placement(new, 1.0)  # not newer
    finally:
        c.close()


def test_a_bogus_server_generation_is_refused_not_overflowed():
    # anyone who reaches a server could once commit generation 2**64 - 1 there; "newest + 1"
    # then overflowed uint64 and killed the reconnecting thread for good
    c, _ = make(FakeServer(), FakeServer(generation=2**64 - 1))
    try:
        with pytest.raises(ExpertServerError) as ei:
            c.connect(5)
        assert isinstance(ei.value.error, errors.Incompatible) and "bogus placement" in str(ei.value)
        c.start(connect_timeout_s=0.2)  # the thread keeps trying (and logging), it does not die
        time.sleep(0.5)
        assert c._thread is not None and c._thread.is_alive() and not c.ready()
    finally:
        c.close()
    with pytest.raises(pl.PlacementError, match="outside"):
        c.placement.with_generation(2**64)


def test_a_newer_generation_committed_by_someone_else_is_renumbered_over():
    gpu, cpu = FakeServer(), FakeServer()
    c, conns = make(gpu, cpu)
    try:
        c.connect(5)
        live = c.placement.generation
        # a third party commits generation live + 1 with another table on cpu0; our next
        # request there is refused as stale and ends the stream
        cpu.generation, cpu.table = live + 1, {0: [0], 1: [0]}
        conns[1].stream = False
        c.ensure_ready(5)
        assert c.placement.generation == live + 2 and gpu.generation == cpu.generation == live + 2
        assert cpu.table == {0: [2, 3], 1: [2, 3]} and c.ready()
    finally:
        c.close()


def test_the_maintenance_thread_survives_a_bug_in_a_round():
    gpu, cpu = FakeServer(), FakeServer()
    c, conns = make(gpu, cpu)
    boom = {"left": 2}
    describe = conns[1].describe

    def flaky(timeout: float) -> WorkerInfo:
        if boom["left"]:
            boom["left"] -= 1
            raise RuntimeError("a bug")
        return describe(timeout)

    try:
        c.connect(5)
        conns[1].describe = flaky  # type: ignore[method-assign]
        conns[1].die()
        cpu.up = True
        c.ensure_ready(5)
        assert boom["left"] == 0 and c.ready()
    finally:
        c.close()


def test_a_down_server_whose_experts_have_live_replicas_is_routed_around_at_once():
    gpu, cpu = FakeServer(), FakeServer()
    file_placement = {0: {"gpu0": [0, 1, 2, 3], "cpu0": [2, 3]}, 1: {"gpu0": [0, 1, 2, 3], "cpu0": [2, 3]}}
    c, conns = make(gpu, cpu)
    c.tables = pl.server_tables(pl.from_server_lists(1, ("gpu0", "cpu0"), 4, file_placement))
    try:
        c.connect(5)
        conns[1].die()  # cpu0's experts 2, 3 are on gpu0 too
        t0 = time.monotonic()
        assert c.ensure_ready(5) == frozenset({1}) and time.monotonic() - t0 < 0.5
        assert c.covered() and not c.ready()
        conns[0].die()  # now nothing holds anything
        cpu.up = False
        with pytest.raises(ExpertServerError) as ei:
            c.ensure_ready(0.2)
        assert "no live server holds layer 0 experts [0, 1, 2, 3] (and 1 more layers)" in str(ei.value)
        assert not c.covered()
    finally:
        c.close()


def test_the_servers_commit_at_once():
    """Between two steps the servers commit concurrently: the pause is the slowest commit, not
    their sum (each fake commit here takes 0.4 s; both start before either ends)."""
    gpu, cpu = FakeServer(), FakeServer()
    c, conns = make(gpu, cpu)
    try:
        c.connect(5)
        started: list[float] = []
        for conn in conns:
            plain = conn.commit

            def slow(generation: int, timeout: float, plain=plain) -> None:
                started.append(time.monotonic())
                time.sleep(0.4)
                plain(generation, timeout)

            conn.commit = slow  # type: ignore[method-assign]
        old = c.placement
        new = pl.from_server_lists(
            old.generation + 1,
            old.servers,
            4,
            {0: {"gpu0": [3, 0], "cpu0": [1, 2]}, 1: {"gpu0": [0, 1], "cpu0": [2, 3]}},
        )
        t0 = time.monotonic()
        assert c.update_placement(new, 5.0) == []
        took = time.monotonic() - t0
        assert len(started) == 2 and abs(started[0] - started[1]) < 0.3, started
        assert gpu.generation == cpu.generation == new.generation
        assert took < 0.75, f"the commits ran one after the other ({took:.2f}s)"
    finally:
        c.close()
