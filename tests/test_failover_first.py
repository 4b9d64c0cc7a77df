"""A hung server collected FIRST in a layer (CPU servers are sent to and collected first) must
not get the healthy servers collected after it marked down: their answers arrived while the
coordinator waited out the hung one's deadline, and are read (shm and gRPC paths alike); the
hung server's pairs are re-sent to the healthy replicas, results equal the reference."""

from __future__ import annotations

import json
import signal

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


def test_a_hung_first_collected_server_does_not_take_the_healthy_one_down(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    gpu, cpu = start_server("gpu", tmp_path), start_server("cpu", tmp_path)
    every = list(range(8))
    spec = {"servers": ["gpu0", "cpu0"], "layers": {"*": {"gpu0": every, "cpu0": every}}}
    (tmp_path / "p.json").write_text(json.dumps(spec))
    servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
    try:
        config = ClusterConfig(
            servers, placement_file=str(tmp_path / "p.json"), replica_policy="round_robin", timeout_s=3.0
        )
        eng, d = engine_for(tmp_path, config)
        prompt = list(range(5, 15))
        want = torch.stack(run_steps(Engine.from_checkpoint(str(tmp_path)), prompt, 2))
        assert rel_err(torch.stack(run_steps(eng, prompt, 2)), want) < 1e-4
        assert [s["transport"] for s in d.server_infos()] == ["shm", "shm"]
        cpu.proc.send_signal(signal.SIGSTOP)  # cpu0: sent to and collected first in every layer
        try:
            assert rel_err(torch.stack(run_steps(eng, prompt, 2)), want) < 1e-4
            states = [s["state"] for s in d.server_infos()]
            assert states == ["ready", "unavailable"], d.server_infos()
        finally:
            cpu.proc.send_signal(signal.SIGCONT)
        d.close()
    finally:
        gpu.stop()
        cpu.stop()
