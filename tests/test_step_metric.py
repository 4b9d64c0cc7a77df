"""The coordinator's per-step wall time (``expertmesh_step_seconds`` and its ``_max`` gauge),
scraped with prometheus_client's text parser from a live coordinator in front of one CPU
expert server: one observation per step, bounded by the requests' wall time, and steps that
overlap a placement push labelled ``moving``, the one that carried the commit at least as long
as the commit the EPLB manager timed; steps that compute prompt tokens labelled ``prefill``, the
others ``decode``."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from benchmarks.bench_rebalance import top, value
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from coordinator.serving.server import CoordinatorConfig
from expertmesh.client import Client
from expertmesh.demo import write_demo_model
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests.cluster_utils import start_server
from tests.serving_utils import ServerThread, one_thread  # noqa: F401 (autouse fixture)
from tests.test_metrics import scrape
from tests.test_serving_cluster import wait_health

pytestmark = pytest.mark.slow


def settled(url: str) -> dict[tuple[str, tuple], float]:
    """A scrape once the last step's time is observed too: the step counter moves inside the
    step, its time just after it."""
    deadline = time.monotonic() + 10
    while True:
        m = scrape(url)
        timed = sum(value(m, "expertmesh_step_seconds_count", placement=p) for p in ("steady", "moving"))
        if timed == value(m, "expertmesh_steps_total") or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    path = write_demo_model(tmp_path_factory.mktemp("demo") / "model")
    srv = start_server("cpu", path, 0, "--threads", "1")
    cfg = CoordinatorConfig(
        model_dir=str(path),
        port=0,
        http_port=0,
        max_running=8,
        cluster=ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),), timeout_s=20.0, transport="grpc"),
    )
    try:
        with ServerThread(cfg) as coord:
            wait_health(coord.addr, "SERVING")
            yield coord, f"http://127.0.0.1:{coord.server.http.port}/metrics"
    finally:
        srv.stop()


def test_one_observation_per_step_within_the_wall_time(coordinator):
    coord, url = coordinator
    m0 = settled(url)
    t0 = time.perf_counter()
    with Client(coord.addr) as c:
        outs = [c.generate(p, max_new_tokens=12, ignore_eos=True) for p in ("Once upon a time", "A cat")]
    m1 = settled(url)
    wall = time.perf_counter() - t0
    assert [o.usage.completion_tokens for o in outs] == [12, 12]

    def d(name: str, **labels: str) -> float:
        return value(m1, name, **labels) - value(m0, name, **labels)

    steps = d("expertmesh_steps_total")
    assert steps >= 24  # two requests one after the other: 12 steps each at least
    assert d("expertmesh_step_seconds_count", placement="steady") == steps
    assert d("expertmesh_step_seconds_count", placement="moving") == 0  # nothing was pushed
    assert d("expertmesh_step_seconds_bucket", placement="steady", le="+Inf") == steps
    spent = d("expertmesh_step_seconds_sum", placement="steady")
    assert 0 < spent <= wall, (spent, wall)
    longest = top(m1, "expertmesh_step_seconds_max", placement="steady")
    assert spent / steps <= longest <= wall
    # each request's prompt is one step (a short prompt is one chunk), the rest decode
    assert d("expertmesh_step_seconds_count", kind="prefill") == 2
    assert d("expertmesh_step_seconds_count", kind="decode") == steps - 2


def test_steps_overlapping_a_push_are_moving(coordinator):
    """An operator's rebalance (pushed even though the cluster is balanced) while requests
    stream: its commit runs between two steps, inside the next step's time."""
    coord, url = coordinator
    m0 = settled(url)
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:  # keeps requests running until the push is over
        try:
            with Client(coord.addr) as c:
                while not stop.is_set():
                    c.generate("the king of the", max_new_tokens=32, ignore_eos=True)
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    workers = [threading.Thread(target=loop) for _ in range(3)]
    for w in workers:
        w.start()
        time.sleep(0.05)  # staggered: some request is running at any moment
    try:
        time.sleep(0.3)
        with grpc.insecure_channel(coord.addr) as ch:
            out = admin_pb2_grpc.AdminStub(ch).Rebalance(admin_pb2.RebalanceRequest(), timeout=60).outcome
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not errors, errors
    assert out.outcome == "rebalanced", out
    m1 = settled(url)
    moving = value(m1, "expertmesh_step_seconds_count", placement="moving") - value(
        m0, "expertmesh_step_seconds_count", placement="moving"
    )
    steady = value(m1, "expertmesh_step_seconds_count", placement="steady") - value(
        m0, "expertmesh_step_seconds_count", placement="steady"
    )
    steps = value(m1, "expertmesh_steps_total") - value(m0, "expertmesh_steps_total")
    assert moving >= 1 and moving + steady == steps, (moving, steady, steps)
    assert top(m1, "expertmesh_step_seconds_max", placement="moving") >= out.commit_ms / 1e3 > 0
