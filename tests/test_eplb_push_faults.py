"""A placement push that meets a fault leaves the cluster consistent: failures that are not a
server's typed answer (a closed channel raises ValueError) abort what was prepared and are
reported, a switch that never found a gap between steps never runs later, and a server out for
a moment (a refused layer ends its stream until the maintenance thread reopens it) does not
fail the push. Fake servers (tests/test_cluster_state.py) stand in for the expert servers."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from coordinator.eplb.manager import EplbManager
from coordinator.eplb.plan import EplbConfig
from coordinator.eplb.target import ClusterTarget
from coordinator.experts import cluster as cl
from coordinator.experts.load_recorder import LoadRecorder
from tests.test_cluster_state import FakeServer, make


def at_once(fn) -> Future:
    f: Future = Future()
    f.set_result(fn())
    return f


def manager(cluster, between=at_once) -> EplbManager:
    rec = LoadRecorder([0, 1], 4, window_steps=4, num_servers=2)
    for _ in range(4):
        for layer in (0, 1):
            rec.record(layer, torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]]))
    cfg = EplbConfig(interval_steps=0, redundant_slots=1)
    return EplbManager(cfg, rec, ClusterTarget(cluster, 2.0), expert_bytes=10, between_steps=between)


@pytest.fixture
def pushed():
    """A connected cluster of a GPU and a CPU fake server: (cluster, conns, gpu, cpu)."""
    gpu, cpu = FakeServer(), FakeServer()
    c, conns = make(gpu, cpu)
    c.connect(5)
    yield c, conns, gpu, cpu
    c.close()


def closed(*args, **kwargs):
    raise ValueError("Cannot invoke RPC on closed channel!")


def test_a_server_out_for_a_moment_does_not_fail_the_push(pushed):
    c, conns, gpu, cpu = pushed
    conns[1].stream = False  # READY, its stream ended: the maintenance thread reopens it
    out = manager(c).rebalance()
    assert out.kind == "rebalanced", out.line()
    assert c.placement.generation == 2 and gpu.generation == 2 and cpu.generation == 2


def test_a_server_that_stays_out_fails_the_push_saying_so(pushed, monkeypatch):
    from coordinator.eplb import target

    monkeypatch.setattr(target, "STUCK_WAIT_S", 0.3)
    c, conns, gpu, cpu = pushed
    cpu.up = False  # gone: nothing reopens it
    out = manager(c).rebalance()
    assert out.kind == "failed" and "not every expert server is ready" in out.error, out.line()
    assert c.placement.generation == 1 and gpu.generation == 1


def test_a_prepare_failing_with_any_error_aborts_every_server(pushed):
    c, conns, gpu, cpu = pushed
    conns[1].prepare = closed  # type: ignore[method-assign]
    out = manager(c).rebalance()
    assert out.kind == "failed" and "closed channel" in out.error, out.line()
    assert gpu.staged is None and ("abort", 2) in gpu.calls  # the prepared one
    assert ("abort", 2) in cpu.calls  # the one that failed (a timed-out one may still load)
    assert c.placement.generation == 1


def test_a_commit_failing_with_any_error_marks_its_server_down_and_is_reported(pushed):
    c, conns, gpu, cpu = pushed
    conns[1].commit = closed  # type: ignore[method-assign]
    out = manager(c).rebalance()
    assert "cpu0" in out.error, out.line()  # before: nothing said, the server stayed READY
    assert gpu.generation == 2 and cpu.generation == 1
    assert c.members[1].last_error and "closed channel" in str(c.members[1].last_error)


def test_a_switch_that_found_no_gap_never_runs_and_the_prepared_are_aborted(pushed, monkeypatch):
    monkeypatch.setattr(cl, "BETWEEN_STEPS_WAIT_S", 0.2)
    c, conns, gpu, cpu = pushed
    queued: list[tuple[object, Future]] = []

    def never(fn) -> Future:  # a scheduler that reaches no gap in time
        f: Future = Future()
        queued.append((fn, f))
        return f

    out = manager(c, never).rebalance()
    assert out.kind == "failed" and "no gap" in out.error, out.line()
    assert gpu.staged is None and cpu.staged is None  # aborted
    fn, f = queued[0]
    assert f.cancelled() and not f.set_running_or_notify_cancel()  # the scheduler skips it
    assert c.placement.generation == 1 and gpu.generation == 1 and cpu.generation == 1
