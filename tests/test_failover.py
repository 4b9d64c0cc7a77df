"""Failover to replicas: a server that stops answering in the middle of a step has its share of
the layer re-sent to live replicas of the same experts (right answers, no error); a lost server
is routed around by the steps after (no wait); a server that answers again rejoins."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.model.engine import Engine
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.test_cluster import engine_for
from tests.test_cluster_faults import run_steps
from tests.test_parity import rel_err

pytestmark = pytest.mark.slow


def test_steps_route_around_a_lost_replica_and_it_rejoins(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    gpu, cpu = start_server("gpu", tmp_path), start_server("cpu", tmp_path)
    # every expert on cpu0; experts 0..3 also on gpu0
    spec = {"servers": ["gpu0", "cpu0"], "layers": {"*": {"gpu0": [0, 1, 2, 3], "cpu0": list(range(8))}}}
    (tmp_path / "p.json").write_text(json.dumps(spec))
    servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
    try:
        eng, d = engine_for(
            tmp_path, ClusterConfig(servers, placement_file=str(tmp_path / "p.json"), timeout_s=5.0)
        )
        prompt = list(range(5, 15))
        want = torch.stack(run_steps(Engine.from_checkpoint(str(tmp_path)), prompt, 3))
        assert rel_err(torch.stack(run_steps(eng, prompt, 3)), want) < 1e-4
        # hung in the middle of a step: its pairs time out and are re-sent to cpu0
        gpu.proc.send_signal(signal.SIGSTOP)
        try:
            assert rel_err(torch.stack(run_steps(eng, prompt, 3)), want) < 1e-4
            assert not d.ready() and d.server_infos()[0]["state"] == "unavailable"
        finally:
            gpu.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not d.ready():  # it rejoins
            assert time.monotonic() < deadline, d.server_infos()
            time.sleep(0.1)
        assert rel_err(torch.stack(run_steps(eng, prompt, 3)), want) < 1e-4
        # killed: the stream's reader sees the loss; the next steps route around it at once
        gpu.kill()
        deadline = time.monotonic() + 10
        while d.ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not d.ready() and d.expert_cluster.covered()
        t0 = time.monotonic()
        assert rel_err(torch.stack(run_steps(eng, prompt, 3)), want) < 1e-4  # on cpu0 alone
        assert time.monotonic() - t0 < 4.0  # no wait for the lost server
        d.close()
    finally:
        gpu.stop()
        cpu.stop()
