"""The ``local`` member through the real CLI: a coordinator subprocess holding experts itself
(``--cpu-server ADDR --num-gpu-experts N``, or a placement file naming ``local``) beside a CPU
expert server subprocess, 8 concurrent streaming clients, half of the requests with a
hot-loaded MoE LoRA adapter.

- experts split: base requests give HF's greedy tokens, adapter requests PEFT's;
- every expert on both members: ``kill -9`` of the CPU server mid-load fails no request and
  every request still gives HF's / PEFT's tokens (its rows fail over to ``local``);
- EPLB rebalancing every few steps under that load moves experts between ``local`` and the CPU
  server (placement pushes, adapter re-pushes) with every token still HF's / PEFT's.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests import lora_utils
from tests.cluster_utils import start_server
from tests.fault_utils import (
    Job,
    load_lora,
    placement_file,
    run_load,
    server_states,
    start_coordinator,
    wait_health,
    wait_states,
)
from tests.serving_utils import hf_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 6
PROMPTS = [tuple((7 * i + j * 3) % 90 + 2 for j in range(4 + i % 3)) for i in range(8)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(root, {prompt: base tokens}, {prompt: adapter tokens}) with HF and PEFT as references."""
    root = tmp_path_factory.mktemp("local_faults")
    hf = lora_utils.make_model("qwen2_moe", root / "model")
    with torch.no_grad():
        base = {p: hf_greedy(hf, list(p), NEW_TOKENS)[0] for p in PROMPTS}
    pm = lora_utils.wrap(hf, seed=3)
    lora_utils.save(pm, root / "adapters" / "a")
    with torch.no_grad():
        adapted = {p: hf_greedy(pm, list(p), NEW_TOKENS)[0] for p in PROMPTS}
    assert base != adapted  # the adapter changes tokens (the test can fail)
    return root, base, adapted


def jobs() -> list[list[Job]]:
    """8 clients, two requests each, alternating base model and adapter."""
    return [[Job(PROMPTS[i], NEW_TOKENS, "a" if (i + r) % 2 else "") for r in range(2)] for i in range(8)]


def check(results, base, adapted) -> None:
    for c, outs in enumerate(results):
        for r, (job, o) in enumerate(zip(jobs()[c], outs, strict=True)):
            assert o.error is None, f"client {c} request {r}: {o.error}"
            want = adapted if job.lora else base
            assert o.tokens == want[job.prompt], f"client {c} request {r} (lora {job.lora!r})"


def flags(root, *extra: str) -> list[str]:
    return [
        "--expert-timeout", "4",
        "--connect-timeout", "2",
        "--lora-dir", str(root / "adapters"),
        "--max-loras", "2",
        "--page-size", "4",
        "--kv-memory", "8MiB",
        *extra,
    ]  # fmt: skip


def test_split_with_an_adapter_matches_hf_and_peft(model):
    root, base, adapted = model
    cpu = start_server("cpu", root / "model")
    co = start_coordinator(
        root / "model", *flags(root, "--cpu-server", cpu.address, "--num-gpu-experts", "3")
    )
    try:
        wait_health(co.addr, "SERVING")
        assert server_states(co.addr) == {"local": "ready", "cpu0": "ready"}
        load_lora(co.addr, "a", root / "adapters" / "a")
        check(run_load(co.addr, jobs()), base, adapted)
    finally:
        co.stop()
        cpu.stop()


def test_cpu_server_killed_mid_stream_fails_nothing_when_replicated(model):
    root, base, adapted = model
    every = list(range(8))
    p = placement_file(root / "both.json", {"*": {"local": every, "cpu0": every}}, ["local", "cpu0"])
    cpu = start_server("cpu", root / "model")
    co = start_coordinator(
        root / "model",
        *flags(root, "--cpu-server", cpu.address, "--placement", p, "--replica-policy", "round_robin"),
    )
    try:
        wait_health(co.addr, "SERVING")
        load_lora(co.addr, "a", root / "adapters" / "a")
        check(run_load(co.addr, jobs()), base, adapted)
        total = len(PROMPTS) * 2 * NEW_TOKENS
        check(run_load(co.addr, jobs(), at_chunks=total // 4, action=cpu.kill), base, adapted)
        assert cpu.proc.poll() is not None
        wait_states(co.addr, {"local": "ready", "cpu0": "unavailable"}, timeout=30)
        check(run_load(co.addr, jobs()), base, adapted)  # on ``local`` alone
    finally:
        co.stop()
        cpu.stop()


def test_eplb_rebalances_across_local_and_the_cpu_server(model):
    root, base, adapted = model
    cpu = start_server("cpu", root / "model")
    eplb = ["--eplb-interval-steps", "3", "--eplb-window-steps", "16", "--eplb-redundant-slots", "2",
            "--eplb-skip-threshold", "0"]  # fmt: skip
    co = start_coordinator(
        root / "model",
        *flags(
            root,
            "--cpu-server",
            cpu.address,
            "--num-gpu-experts",
            "3",
            "--replica-policy",
            "load_aware",
            *eplb,
        ),
    )
    try:
        wait_health(co.addr, "SERVING")
        load_lora(co.addr, "a", root / "adapters" / "a")
        check(run_load(co.addr, jobs()), base, adapted)
        with grpc.insecure_channel(co.addr) as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            st = stub.GetEplbStatus(admin_pb2.GetEplbStatusRequest(), timeout=10)
            placement = stub.GetPlacement(admin_pb2.GetPlacementRequest(), timeout=10)
        assert st.rebalanced >= 1 and st.failed == 0, (st, co.output()[-3000:])
        assert list(placement.servers) == ["local", "cpu0"] and placement.generation > 1
        check(run_load(co.addr, jobs()), base, adapted)  # on the rebalanced placement
    finally:
        co.stop()
        cpu.stop()
