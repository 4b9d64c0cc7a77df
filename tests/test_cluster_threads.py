"""Losing an expert server must not leak coordinator threads: the dead stream's request
iterator is ended, so gRPC's thread that consumes it exits (it used to wait on the queue
forever: one thread per loss)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from coordinator.experts.remote import ClusterConfig, RemoteDispatcher, ServerSpec
from expertmesh.checkpoint import CheckpointReader
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint

pytestmark = pytest.mark.slow


def test_server_loss_and_rejoin_leak_no_threads(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    cfg = CheckpointReader(tmp_path).config
    srv = start_server("cpu", tmp_path)
    port = srv.port
    d = RemoteDispatcher(
        cfg,
        ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),), transport="grpc", timeout_s=5.0),
        torch.float32,
    )
    x = torch.randn(2, cfg.hidden_size)
    ids = torch.zeros(2, cfg.top_k, dtype=torch.long)
    w = torch.ones(2, cfg.top_k)

    def serve_once() -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                d.begin_step(2)
                d.submit(cfg.moe_layer_ids[0], x, ids, w).wait()
                return
            except Exception:  # noqa: BLE001 - retried until the restarted server answers
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    try:
        d.connect(60)
        counts = []
        for _ in range(1):  # one loss shows it (each cycle costs a server start)
            serve_once()
            time.sleep(0.3)
            counts.append(threading.active_count())
            srv.kill()
            deadline = time.monotonic() + 10
            while d.ready() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not d.ready()
            srv = start_server("cpu", tmp_path, port)
        serve_once()
        time.sleep(0.3)
        counts.append(threading.active_count())
        assert counts[-1] <= counts[0], counts  # was +1 per lost server
    finally:
        d.close()
        srv.stop()
