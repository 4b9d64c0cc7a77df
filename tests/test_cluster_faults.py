"""Expert server faults during a multi-step run: a hung server times out, a killed server
fails fast; both with a clear status, and a resumed/restarted server is used again."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ExpertServerError, ServerSpec
from coordinator.model.engine import Engine
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.test_cluster import engine_for
from tests.test_parity import rel_err

pytestmark = pytest.mark.slow
TIMEOUT_S = 3.0


def run_steps(eng: Engine, prompt: list[int], steps: int) -> list[torch.Tensor]:
    sid = eng.new_seq()
    try:
        out = [eng.step([(sid, prompt)])[0]]
        for _ in range(steps - 1):
            out.append(eng.step([(sid, [int(out[-1].argmax())])])[0])
        return out
    finally:
        eng.free(sid)


def test_server_hang_and_kill_then_recover(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    gpu = start_server("gpu", tmp_path)
    cpu = start_server("cpu", tmp_path)
    try:
        servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
        eng, d = engine_for(tmp_path, ClusterConfig(servers, num_gpu_experts=4, timeout_s=TIMEOUT_S))
        ref = Engine.from_checkpoint(str(tmp_path))
        prompt = list(range(5, 15))
        want = run_steps(ref, prompt, 4)
        got = run_steps(eng, prompt, 4)
        assert rel_err(torch.stack(got), torch.stack(want)) < 1e-4

        # a hung server: the step fails with DEADLINE_EXCEEDED within the timeout
        cpu.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ExpertServerError) as ei:
            run_steps(eng, prompt, 2)
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "cpu0" in str(ei.value)
        assert time.monotonic() - t0 < TIMEOUT_S + 6
        assert not d.ready()
        cpu.proc.send_signal(signal.SIGCONT)
        assert rel_err(torch.stack(run_steps(eng, prompt, 4)), torch.stack(want)) < 1e-4
        assert d.ready()

        # a killed server: the step fails fast with UNAVAILABLE
        port = cpu.port
        cpu.kill()
        t0 = time.monotonic()
        with pytest.raises(ExpertServerError) as ei:
            run_steps(eng, prompt, 3)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE, ei.value
        assert time.monotonic() - t0 < TIMEOUT_S + 6
        # restarted on the same port (a fresh process at placement generation 0): the
        # coordinator re-pushes its placement and later requests succeed
        cpu = start_server("cpu", tmp_path, port)
        deadline = time.monotonic() + 30
        while True:
            try:
                got = run_steps(eng, prompt, 4)
                break
            except ExpertServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert rel_err(torch.stack(got), torch.stack(want)) < 1e-4
        assert d.ready()
        assert len(eng.seqs) == 0 and eng.pages.num_free == eng.pages.num_pages
        d.close()
    finally:
        gpu.stop()
        cpu.proc.send_signal(signal.SIGCONT)
        cpu.stop()
