"""EPLB manager with an in-memory target: periodic trigger, skip, failure -> abort, dry run."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from coordinator.eplb.manager import EplbManager
from coordinator.eplb.plan import EplbConfig
from coordinator.experts.load_recorder import LoadRecorder
from expertmesh import placement as pl

LAYERS, EXPERTS = [0, 1], 8


class PushFailed(RuntimeError):
    pass


class FakeTarget:
    errors = (PushFailed,)

    def __init__(self, fail_prepare: bool = False) -> None:
        self.live = pl.static_split(LAYERS, EXPERTS, [], ["cpu0", "cpu1"], 0)
        self.fail_prepare = fail_prepare
        self.calls: list[tuple[str, int]] = []

    def live_placement(self) -> pl.Placement:
        return self.live

    def slot_capacity(self) -> torch.Tensor:
        return torch.tensor([EXPERTS, EXPERTS])

    def default_speed(self) -> torch.Tensor:
        return torch.ones(2)

    def push(self, placement: pl.Placement, between_steps) -> list[str]:
        self.calls.append(("prepare", placement.generation))
        if self.fail_prepare:
            self.calls.append(("abort", placement.generation))
            raise PushFailed("cpu1: connection refused")

        def commit() -> None:
            self.calls.append(("commit", placement.generation))
            self.live = placement

        between_steps(commit).result()
        return []


def now(fn) -> Future:
    f: Future = Future()
    f.set_result(fn())
    return f


def skewed_steps(rec: LoadRecorder, steps: int) -> None:
    for _ in range(steps):
        for layer in LAYERS:  # experts 0 and 1 (both on cpu0) take most tokens
            rec.record(layer, torch.tensor([[0, 1], [0, 1], [0, 2], [1, 5]]))


def manager(target: FakeTarget, interval: int = 4) -> tuple[EplbManager, LoadRecorder]:
    rec = LoadRecorder(LAYERS, EXPERTS, window_steps=8, num_servers=2)
    cfg = EplbConfig(interval_steps=interval, window_steps=8, redundant_slots=1)
    return EplbManager(cfg, rec, target, expert_bytes=100, between_steps=now), rec


def test_periodic_rebalance_prepares_then_commits():
    target = FakeTarget()
    m, rec = manager(target)
    for _ in range(4):
        skewed_steps(rec, 1)
        m.on_step()
    m.wait_idle()
    assert m.counters.rebalanced == 1 and m.counters.failed == 0
    assert target.calls == [("prepare", 2), ("commit", 2)]
    assert target.live.generation == 2
    out = m.counters.history[-1]
    assert out.plan is not None and out.plan.token_balance_after < out.plan.token_balance_before
    # same load, already balanced: the next periodic run is skipped and counted
    for _ in range(4):
        skewed_steps(rec, 1)
        m.on_step()
    m.wait_idle()
    assert m.counters.skipped == 1 and target.live.generation == 2


def test_failed_prepare_aborts_and_keeps_the_old_placement():
    target = FakeTarget(fail_prepare=True)
    m, rec = manager(target)
    skewed_steps(rec, 4)
    out = m.rebalance()
    assert out.kind == "failed" and "connection refused" in out.error
    assert target.calls == [("prepare", 2), ("abort", 2)]
    assert target.live.generation == 1 and m.counters.failed == 1


def test_dry_run_plans_without_pushing():
    target = FakeTarget()
    m, rec = manager(target, interval=0)
    skewed_steps(rec, 4)
    m.on_step()  # interval 0: periodic rebalancing is off
    out = m.rebalance(dry_run=True)
    assert out.kind == "dry-run" and out.plan is not None and out.plan.placement is not None
    assert target.calls == [] and m.counters.dry_runs == 1


def test_set_placement_pushes_the_next_generation():
    target = FakeTarget()
    m, _ = manager(target, interval=0)
    wanted = pl.from_server_lists(
        7,
        ("cpu0", "cpu1"),
        EXPERTS,
        {layer: {"cpu0": [0, 2, 4, 6], "cpu1": [1, 3, 5, 7, 0]} for layer in LAYERS},
    )
    out = m.set_placement(wanted)
    assert out.kind == "placement-set" and m.counters.placements_set == 1
    assert target.live.generation == 2  # numbered after the live one, not the file's
    assert target.live.layers[0].server_experts(1) == [1, 3, 5, 7, 0]


# ------------------------------------------------------------ through the real ExpertCluster


def cluster_manager():
    from coordinator.eplb.target import ClusterTarget
    from tests.test_cluster_state import FakeServer, make

    gpu, cpu = FakeServer(capacity=4), FakeServer(capacity=4)
    cluster, conns = make(gpu, cpu)
    cluster.connect(5)
    rec = LoadRecorder([0, 1], 4, window_steps=4, num_servers=2)
    for _ in range(4):
        for layer in (0, 1):  # expert 0 (on gpu0) takes most tokens
            rec.record(layer, torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]]))
    cfg = EplbConfig(interval_steps=0, redundant_slots=1)
    m = EplbManager(cfg, rec, ClusterTarget(cluster, 2.0), expert_bytes=10, between_steps=now)
    return m, cluster, gpu, cpu, conns


def test_cluster_target_pushes_through_the_expert_cluster():
    m, cluster, gpu, cpu, _ = cluster_manager()
    try:
        out = m.rebalance()
        assert out.kind == "rebalanced", out.line()
        assert cluster.placement.generation == 2 and gpu.generation == cpu.generation == 2
        assert gpu.calls[-2:] == [("prepare", 2), ("commit", 2)]
        # expert 0 is replicated on both servers
        assert 0 in gpu.table[0] and 0 in cpu.table[0]
    finally:
        cluster.close()


def test_cluster_target_needs_every_server_and_aborts_on_a_failed_prepare():
    m, cluster, gpu, cpu, conns = cluster_manager()
    try:
        conns[1].die()  # down before the rebalance: nobody is asked to prepare
        out = m.rebalance()
        assert out.kind == "failed" and "not every expert server is ready" in out.error
        assert ("prepare", 2) not in gpu.calls and cluster.placement.generation == 1
        cpu.up = True
        cluster.ensure_ready(5.0)
        cpu.fail.add("prepare")  # up, but cannot load: the prepared gpu0 is aborted
        out = m.rebalance()
        assert out.kind == "failed" and "cannot load" in out.error
        assert gpu.calls[-2:] == [("prepare", 2), ("abort", 2)] and gpu.generation == 1
        assert cluster.placement.generation == 1 and m.counters.failed == 2
    finally:
        cluster.close()
