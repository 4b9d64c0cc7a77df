"""Faults on the TCP data path, on real processes. kill -9 of a replica in the middle of a
streaming load (a coordinator, a GPU expert server on the CPU and a CPU expert server, 8
concurrent streaming clients, half of them with a MoE LoRA adapter whose slots travel in the
frames): no request fails and no token changes (the pending layer goes to the live replica, as
on gRPC), and the server restarted on its port rejoins over TCP. A stopped replica times out and
its rows fail over; a SIGTERM drain fails no request."""

from __future__ import annotations

import json
import signal
import time

import grpc
import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.model.engine import Engine
from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests import lora_utils
from tests.cluster_utils import start_server
from tests.fault_utils import (
    Job,
    Zygote,
    load_lora,
    placement_file,
    run_load,
    start_coordinator,
    wait_health,
    wait_states,
)
from tests.hf_models import make_checkpoint
from tests.test_cluster import engine_for
from tests.test_cluster_faults import run_steps
from tests.test_drain import PROMPTS
from tests.test_fault_tolerance import BOTH_READY, coordinator_flags, jobs, tokens
from tests.test_parity import rel_err

pytestmark = pytest.mark.slow


def transports(addr: str) -> dict[str, str]:
    with grpc.insecure_channel(addr) as ch:
        resp = admin_pb2_grpc.AdminStub(ch).ListServers(admin_pb2.ListServersRequest(), timeout=10)
    return {s.name: s.transport for s in resp.servers}


def test_kill_9_of_a_replica_on_tcp_fails_nothing(tmp_path):
    hf = lora_utils.make_model("qwen2_moe", tmp_path / "model")
    lora_utils.save(lora_utils.wrap(hf, seed=3), tmp_path / "adapters" / "a")
    zygote = Zygote(tmp_path)
    every = list(range(8))
    p = placement_file(tmp_path / "both.json", {"*": {"gpu0": every, "cpu0": every}}, ["gpu0", "cpu0"])
    gpu, cpu = zygote.start("gpu", tmp_path / "model"), zygote.start("cpu", tmp_path / "model")
    co = None
    try:
        co = start_coordinator(
            tmp_path / "model",
            "--gpu-server", gpu.address, "--cpu-server", cpu.address,
            "--replica-policy", "round_robin", "--transport", "tcp",
            *coordinator_flags(tmp_path, p),
        )  # fmt: skip
        wait_health(co.addr, "SERVING")
        assert transports(co.addr) == {"gpu0": "tcp", "cpu0": "tcp"}
        load_lora(co.addr, "a", tmp_path / "adapters" / "a")
        want = tokens(run_load(co.addr, jobs()))
        total = sum(len(t) for outs in want for t in outs)
        got = run_load(co.addr, jobs(), at_chunks=total // 4, action=cpu.kill)
        assert tokens(got) == want  # no request failed, no token changed
        assert not cpu.alive()
        cpu = zygote.start("cpu", tmp_path / "model", cpu.port)
        wait_states(co.addr, BOTH_READY, timeout=30)
        assert transports(co.addr) == {"gpu0": "tcp", "cpu0": "tcp"}
        assert tokens(run_load(co.addr, jobs(1))) == [w[:1] for w in want]
    finally:
        if co is not None:
            co.stop()
        gpu.stop()
        cpu.stop()
        zygote.close()


def test_a_stalled_replica_on_tcp_times_out_and_its_rows_fail_over(tmp_path):
    """SIGSTOP: the server's data connection stays open but answers nothing; the layer's
    deadline ends the wait, the rows go to the live replica, the server rejoins after SIGCONT."""
    make_checkpoint("qwen3_moe", tmp_path)
    gpu, cpu = start_server("gpu", tmp_path), start_server("cpu", tmp_path)
    spec = {"servers": ["gpu0", "cpu0"], "layers": {"*": {"gpu0": [0, 1, 2, 3], "cpu0": list(range(8))}}}
    (tmp_path / "p.json").write_text(json.dumps(spec))
    servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
    cfg = ClusterConfig(servers, placement_file=str(tmp_path / "p.json"), timeout_s=3.0, transport="tcp")
    try:
        eng, d = engine_for(tmp_path, cfg)
        prompt = list(range(5, 15))
        want = torch.stack(run_steps(Engine.from_checkpoint(str(tmp_path)), prompt, 3))
        assert rel_err(torch.stack(run_steps(eng, prompt, 3)), want) < 1e-4
        assert [i["transport"] for i in d.server_infos()] == ["tcp", "tcp"]
        gpu.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert rel_err(torch.stack(run_steps(eng, prompt, 3)), want) < 1e-4
            assert time.monotonic() - t0 < 3 * 3.0 + 5  # one deadline, then routed around
            assert d.server_infos()[0]["state"] == "unavailable"
        finally:
            gpu.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not d.ready():
            assert time.monotonic() < deadline, d.server_infos()
            time.sleep(0.1)
        assert rel_err(torch.stack(run_steps(eng, prompt, 3)), want) < 1e-4
        assert [i["transport"] for i in d.server_infos()] == ["tcp", "tcp"]
        d.close()
    finally:
        gpu.stop()
        cpu.stop()


def test_sigterm_drains_a_server_on_tcp_without_failing_requests(tmp_path):
    """A draining server refuses new layers with UNAVAILABLE on the data connection too: the
    coordinator re-sends them to the replica, closes its stream, and the server exits 0 long
    before its drain timeout."""
    make_checkpoint("qwen3_moe", tmp_path)
    every = list(range(8))
    p = placement_file(tmp_path / "both.json", {"*": {"gpu0": every, "cpu0": every}}, ["gpu0", "cpu0"])
    gpu = start_server("gpu", tmp_path, 0, "--drain-timeout", "30")
    cpu = start_server("cpu", tmp_path, 0, "--drain-timeout", "30")
    co = None
    try:
        co = start_coordinator(
            tmp_path, "--gpu-server", gpu.address, "--cpu-server", cpu.address, "--placement", p,
            "--replica-policy", "round_robin", "--expert-timeout", "5", "--kv-memory", "8MiB",
            "--transport", "tcp",
        )  # fmt: skip
        jobs = [[Job(q, 8)] for q in PROMPTS]
        wait_health(co.addr, "SERVING")
        assert transports(co.addr) == {"gpu0": "tcp", "cpu0": "tcp"}
        want = tokens(run_load(co.addr, jobs))
        sent: list[float] = []

        def sigterm() -> None:
            sent.append(time.monotonic())
            cpu.proc.send_signal(signal.SIGTERM)

        assert tokens(run_load(co.addr, jobs, at_chunks=10, action=sigterm)) == want
        assert cpu.proc.wait(20) == 0, cpu.output()
        assert "drained: no coordinator stream left" in cpu.output(), cpu.output()
        assert time.monotonic() - sent[0] < 15
        assert tokens(run_load(co.addr, jobs)) == want  # on gpu0 alone
    finally:
        if co is not None:
            co.stop()
        gpu.stop(40)
        cpu.stop(40)
