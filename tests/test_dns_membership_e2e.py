"""``--cpu-server dns:///NAME:PORT`` with real processes: CPU expert servers on loopback addresses
127.0.0.2, .3, .4 (one port, as the pods behind a headless Service), the name resolved through
``--dns-hosts-file`` (the one lookup that differs from a cluster's getaddrinfo), a coordinator
process. Greedy tokens equal HF transformers' throughout: with the two servers found at start,
after the server at .3 is replaced by one at .4 (it takes cpu1's place and experts), and while the
one at .4 leaves the name under load (routed around as a drained server: 0 failed requests)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import grpc
import pytest

from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from tests.cluster_utils import ServerProc, start_server
from tests.fault_utils import Job, placement_file, run_load, start_coordinator, wait_health
from tests.hf_models import make_checkpoint
from tests.serving_utils import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [(5, 9, 3), (17, 2, 8, 8), (4, 4, 21, 30, 2), (11, 6)]
NEW_TOKENS = 8
IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def _port_free_on_all() -> int:
    """One port free on every address of IPS (pods behind one name share the port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((IPS[0], 0))
            port = s.getsockname()[1]
            try:
                for ip in IPS[1:]:
                    with socket.socket() as t:
                        t.bind((ip, port))
            except OSError:
                continue
        return port
    raise AssertionError("no port free on all of " + ", ".join(IPS))


def _servers(addr: str) -> dict[str, tuple[str, str]]:
    with grpc.insecure_channel(addr) as ch:
        resp = admin_pb2_grpc.AdminStub(ch).ListServers(admin_pb2.ListServersRequest(), timeout=10)
    return {s.name: (s.address, s.state) for s in resp.servers}


def _wait_servers(addr: str, want: dict[str, tuple[str, str]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := _servers(addr)) != want:
        assert time.monotonic() < deadline, f"servers {got}, waited {timeout}s for {want}"
        time.sleep(0.1)


def _tokens(results) -> list[list[int]]:
    out = []
    for client in results:
        for o in client:
            assert o.error is None, o.error
            out.append(o.tokens)
    return out


def test_a_dns_named_pool_follows_its_name(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    model = tmp_path / "model"
    make_checkpoint("qwen3_moe", model)
    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager").eval()
    refs = [hf_greedy(hf, list(p), NEW_TOKENS)[0] for p in PROMPTS]
    port = _port_free_on_all()
    hosts = tmp_path / "hosts"

    def name_resolves_to(*ips: str) -> None:
        hosts.write_text("".join(f"{ip} experts.test  # a pod\n" for ip in ips))

    started: list[ServerProc] = []
    every = list(range(8))  # both servers hold every expert: either can take all tokens
    placement = placement_file(tmp_path / "p.json", {"*": {"cpu0": every, "cpu1": every}}, ["cpu0", "cpu1"])
    name_resolves_to(IPS[1], IPS[0])
    co = None
    try:
        for ip in IPS:  # .4 is not named yet: the coordinator does not know it
            started.append(start_server("cpu", model, port, "--host", ip))
        old = started[1]
        co = start_coordinator(
            model, "--cpu-server", f"dns:///experts.test:{port}", "--dns-hosts-file", str(hosts),
            "--dns-refresh-s", "0.2", "--placement", placement, "--replica-policy", "round_robin",
            "--expert-timeout", "5", "--kv-memory", "8MiB",
        )  # fmt: skip
        wait_health(co.addr, "SERVING")
        # named by the sorted addresses, whatever order the name gave them in
        _wait_servers(co.addr, {"cpu0": (f"{IPS[0]}:{port}", "ready"), "cpu1": (f"{IPS[1]}:{port}", "ready")})
        jobs = [[Job(p, NEW_TOKENS)] for p in PROMPTS]
        assert _tokens(run_load(co.addr, jobs)) == refs

        # the server at .3 dies and a new one appears at .4: it becomes cpu1, with cpu1's experts
        old.kill()
        name_resolves_to(IPS[0], IPS[2])
        _wait_servers(co.addr, {"cpu0": (f"{IPS[0]}:{port}", "ready"), "cpu1": (f"{IPS[2]}:{port}", "ready")})
        assert _tokens(run_load(co.addr, jobs)) == refs

        # .4 leaves the name while requests run: routed around, no request fails
        got = run_load(co.addr, [j * 3 for j in jobs], at_chunks=6, action=lambda: name_resolves_to(IPS[0]))
        assert _tokens(got) == [r for r in refs for _ in range(3)]
        _wait_servers(
            co.addr, {"cpu0": (f"{IPS[0]}:{port}", "ready"), "cpu1": (f"{IPS[2]}:{port}", "unavailable")}
        )
        assert _tokens(run_load(co.addr, jobs)) == refs
        assert co.proc.poll() is None
    finally:
        if co is not None:
            co.stop()
        for s in started:
            s.stop()
