"""kill -9 of a replica on the TCP data path in the middle of a streaming load: no request
fails and no token changes (the coordinator's pending layer goes to the live replica, as on
gRPC); the server restarted on its port rejoins over TCP. Real processes: a coordinator, a GPU
expert server (on the CPU) and a CPU expert server, 8 concurrent streaming clients, half of
them with a MoE LoRA adapter (its slots travel in the frames)."""

from __future__ import annotations

import grpc
import pytest

from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests import lora_utils
from tests.fault_utils import (
    Zygote,
    load_lora,
    placement_file,
    run_load,
    start_coordinator,
    wait_health,
    wait_states,
)
from tests.test_fault_tolerance import BOTH_READY, coordinator_flags, jobs, tokens

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
