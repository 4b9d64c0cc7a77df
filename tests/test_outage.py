"""The cluster during an outage, with fake connections (no processes): once serving, a step is
told at once which servers to route around even when some experts have no live server
(``step_down``); a step that needs such an expert may wait only at the start of the outage
(``outage_wait``, counted from the loss); admission (``serving_some``) stays open while some
server is live; the lost-experts status names the layer, the experts and the server."""

from __future__ import annotations

import time

import pytest

from coordinator.experts.expert_conn import ExpertServerError
from tests.test_cluster_state import FakeServer, make


def test_outage_steps_are_not_held_and_the_status_names_what_is_lost():
    gpu, cpu = FakeServer(), FakeServer()
    c, conns = make(gpu, cpu)  # experts 0, 1 on gpu0; 2, 3 on cpu0 (no replicas)
    try:
        c.connect(5)
        assert c.step_down(5) == frozenset() and c.serving_some()
        assert c.outage_wait(5.0) == 5.0  # nothing is down
        conns[1].die()
        cpu.up = False
        t0 = time.monotonic()
        assert c.step_down(5) == frozenset({1})  # no wait, although experts 2, 3 are lost
        assert time.monotonic() - t0 < 0.5
        assert not c.covered() and c.serving_some()  # health NOT_SERVING, requests admitted
        assert 4.5 < c.outage_wait(5.0) <= 5.0  # the loss just happened
        time.sleep(0.3)
        assert c.outage_wait(0.2) == 0.0  # past the window: steps needing 2, 3 fail at once
        err = c.lost_experts(0, [3], c.down())
        assert isinstance(err, ExpertServerError)
        assert "expert server cpu0 (fake:2) is not ready" in str(err)
        assert "no live server holds layer 0 experts [3]" in str(err)
        conns[0].die()
        gpu.up = False
        assert not c.serving_some()  # nothing live: refused at admission
        # back: the cluster's thread re-pushes and both are usable; the outage clock resets
        gpu.up = cpu.up = True
        gpu.generation = cpu.generation = 0
        c.ensure_ready(5)
        assert c.step_down(5) == frozenset() and c.outage_wait(5.0) == 5.0
    finally:
        c.close()


def test_before_the_first_placement_a_step_waits_for_the_bring_up():
    gpu, cpu = FakeServer(), FakeServer()
    cpu.up = False
    c, _ = make(gpu, cpu)
    try:
        c.start(connect_timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(ExpertServerError):
            c.step_down(0.5)
        assert 0.4 < time.monotonic() - t0 < 3.0
        assert not c.serving and not c.serving_some()
    finally:
        c.close()
