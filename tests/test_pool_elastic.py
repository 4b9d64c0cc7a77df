"""An elastic expert pool, as processes, each role on its own loopback address: two coordinators
(127.0.0.5, .6, ``--placement-lease``) share CPU expert servers named by one DNS name
(``--cpu-server dns:///experts.test:PORT``, resolved through ``--dns-hosts-file``: the one
lookup that differs from a cluster's getaddrinfo).

- a third expert server started mid-run and added to the name joins both coordinators holding
  nothing, and the placement holder's next rebalance gives it copies of experts (none moved off
  the others); it then answers tokens, and both coordinators give HF's greedy tokens;
- SIGTERM of an expert server whose experts all have replicas elsewhere, while both
  coordinators stream: 0 failed requests, HF's tokens; the holder re-places its experts on the
  rest (it holds no slot in the next generation, which both coordinators serve), and the server
  exits once both coordinators closed their streams (well before its drain timeout).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from tests.cluster_utils import spawn
from tests.fault_utils import Job, Zygote, placement_file, run_load, wait_health
from tests.hf_models import make_checkpoint
from tests.serving_utils import hf_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 6
PROMPTS = [tuple((7 * i + j * 3) % 90 + 2 for j in range(3 + i % 3)) for i in range(6)]
SERVER_IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
COORD_IPS = ("127.0.0.5", "127.0.0.6")


def port_free_on_all(ips: tuple[str, ...]) -> int:
    """One port free on every address (the pods behind one name share the port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = s.getsockname()[1]
            try:
                for ip in ips[1:]:
                    with socket.socket() as t:
                        t.bind((ip, port))
            except OSError:
                continue
        return port
    raise AssertionError("no port free on all of " + ", ".join(ips))


class Coordinator:
    def __init__(self, host: str, model: Path, *flags: str) -> None:
        cmd = [sys.executable, "-m", "expertmesh.cli", "coordinator", "--model", str(model)]
        cmd += ["--host", host, "--port", "0", "--threads", "1", *flags]
        self.proc, self.lines, m = spawn(cmd, re.compile(r"coordinator listening on (\S+):(\d+)"), 120)
        self.addr = f"{host}:{m.group(2)}"

    def _stub(self, ch: grpc.Channel) -> admin_pb2_grpc.AdminStub:
        return admin_pb2_grpc.AdminStub(ch)

    def placement(self) -> admin_pb2.PlacementInfo:
        with grpc.insecure_channel(self.addr) as ch:
            return self._stub(ch).GetPlacement(admin_pb2.GetPlacementRequest(), timeout=10)

    def servers(self) -> dict[str, tuple[str, int]]:
        """name -> (state, slots per layer the live placement gives it)."""
        with grpc.insecure_channel(self.addr) as ch:
            resp = self._stub(ch).ListServers(admin_pb2.ListServersRequest(), timeout=10)
        return {s.name: (s.state, s.slots_used) for s in resp.servers}

    def rebalance(self) -> admin_pb2.RebalanceOutcome:
        with grpc.insecure_channel(self.addr) as ch:
            return self._stub(ch).Rebalance(admin_pb2.RebalanceRequest(), timeout=60).outcome

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:  # noqa: BLE001 - a stuck one is killed
                self.proc.kill()
                self.proc.wait(10)


def served_tokens(address: str) -> int:
    """(token, expert) pairs the expert server computed since it started, all layers."""
    with grpc.insecure_channel(address) as ch:
        r = pb_grpc.ExpertWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)
    return sum(sum(ls.tokens_per_expert) for ls in r.layers)


def through_both(coords: list[Coordinator], jobs: list[list[Job]], **kw) -> list[list[list[int]]]:
    """The same clients through every coordinator at once; each one's tokens (an error fails)."""
    results: list = [None] * len(coords)

    def run(i: int) -> None:
        results[i] = run_load(coords[i].addr, jobs, **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(coords))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    out = []
    for c, res in zip(coords, results):
        assert res is not None, f"{c.addr}: the load did not finish"
        errors = [o.error for outs in res for o in outs if o.error is not None]
        assert not errors, f"{c.addr}: {len(errors)} failed requests: {errors[:3]}"
        out.append([[o.tokens for o in outs] for outs in res])
    return out


def wait_for(what: str, fn, timeout: float = 30.0, show=lambda: ""):
    deadline = time.monotonic() + timeout
    while not (got := fn()):
        assert time.monotonic() < deadline, f"waited {timeout}s for {what}; {show()}"
        time.sleep(0.1)
    return got


def test_a_server_joins_through_dns_and_a_sigtermed_one_leaves_without_failing_requests(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    model = tmp_path / "model"
    make_checkpoint("qwen3_moe", model)
    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager").eval()
    want = [[hf_greedy(hf, list(p), NEW_TOKENS)[0]] for p in PROMPTS]
    jobs = [[Job(p, NEW_TOKENS)] for p in PROMPTS]
    port = port_free_on_all(SERVER_IPS)
    hosts = tmp_path / "hosts"

    def name_resolves_to(*ips: str) -> None:
        hosts.write_text("".join(f"{ip} experts.test\n" for ip in ips))

    # cpu0 holds every expert; cpu1 copies of half of them (each is replicated on cpu0)
    every, half = list(range(8)), [0, 1, 2, 3]
    placement = placement_file(tmp_path / "p.json", {"*": {"cpu0": every, "cpu1": half}}, ["cpu0", "cpu1"])
    name_resolves_to(*SERVER_IPS[:2])
    zygote = Zygote(tmp_path)
    coords: list[Coordinator] = []
    try:
        servers = [
            zygote.start("cpu", model, port, "--host", ip, "--drain-timeout", "30") for ip in SERVER_IPS[:2]
        ]
        flags = [
            "--cpu-server", f"dns:///experts.test:{port}", "--dns-hosts-file", str(hosts),
            "--dns-refresh-s", "0.2", "--placement", placement, "--replica-policy", "round_robin",
            "--placement-lease", "2", "--expert-timeout", "5", "--kv-memory", "8MiB",
        ]  # fmt: skip
        coords = [Coordinator(ip, model, *flags) for ip in COORD_IPS]
        for c in coords:
            wait_health(c.addr, "SERVING", timeout=60)
        two = {"cpu0": ("ready", 8), "cpu1": ("ready", 4)}
        for c in coords:
            wait_for(f"{c.addr} serving through both", lambda c=c: c.servers() == two, show=c.servers)
        assert through_both(coords, jobs) == [want, want]

        # --- a third server starts mid-run and its address joins the name ---
        servers.append(zygote.start("cpu", model, port, "--host", SERVER_IPS[2], "--drain-timeout", "30"))
        name_resolves_to(*SERVER_IPS)
        three = {**two, "cpu2": ("ready", 0)}  # joined, holding nothing yet
        for c in coords:
            wait_for(f"{c.addr} with cpu2 joined", lambda c=c: c.servers() == three)
        assert through_both(coords, jobs) == [want, want]
        third = f"{SERVER_IPS[2]}:{port}"
        assert served_tokens(third) == 0

        ps = wait_for("one placement holder", lambda: (p := coords[0].placement()).placement_holder and p)
        ids = [c.placement().coordinator_id for c in coords]
        holder = coords[ids.index(ps.placement_holder)]
        out = holder.rebalance()
        assert out.outcome == "rebalanced" and "cpu2 joined" in out.reason, out
        gen = out.generation
        for layer in json.loads(out.placement_json)["layers"].values():
            assert layer["cpu0"] == every and layer["cpu1"] == half and len(layer["cpu2"]) == 6, layer
        # copies only: cpu0 and cpu1 keep theirs, cpu2 gets its share (the mean of theirs: 6)
        grown = {"cpu0": ("ready", 8), "cpu1": ("ready", 4), "cpu2": ("ready", 6)}
        for c in coords:
            wait_for(f"{c.addr} at generation {gen}", lambda c=c: c.placement().generation == gen)
            assert c.servers() == grown
        assert through_both(coords, jobs) == [want, want]
        assert served_tokens(third) > 0  # it answers tokens of the next requests

        # --- SIGTERM of cpu1 (its experts all have copies on cpu0) while both coordinators stream ---
        leaving = servers[1]
        sent: list[float] = []

        def sigterm() -> None:
            sent.append(time.monotonic())
            os.kill(leaving.pid, signal.SIGTERM)

        got = through_both(coords, [js * 3 for js in jobs], at_chunks=len(jobs) * 4, action=sigterm)
        assert got == [[w * 3 for w in want]] * 2  # 0 failed requests, HF's tokens
        wait_for("cpu1 to exit", lambda: not leaving.alive(), timeout=20)
        assert time.monotonic() - sent[0] < 15  # moved off: no wait for the 30 s drain timeout
        assert "drained: no coordinator stream left" in leaving.log.read_text()
        # the holder re-placed cpu1's experts on the rest; both serve that generation
        for c in coords:
            wait_for(
                f"{c.addr} without slots on cpu1",
                lambda c=c: c.placement().generation > gen and c.servers()["cpu1"] == ("unavailable", 0),
                show=lambda c=c: (
                    f"{c.servers()} generation {c.placement().generation}\n" + "".join(c.lines[-40:])
                ),
            )
        assert len({c.placement().generation for c in coords}) == 1
        assert through_both(coords, jobs) == [want, want]
    finally:
        for c in coords:
            c.stop()
        zygote.close()


def test_sigterm_of_a_server_holding_the_only_copies_fails_no_request_when_the_rest_can_hold_them(
    tmp_path: Path,
):
    """A static split (each expert once): the draining server keeps answering the coordinator
    until the re-placement on the other server is live, then it is routed around and exits."""
    from transformers import AutoModelForCausalLM

    model = tmp_path / "model"
    make_checkpoint("qwen3_moe", model)
    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager").eval()
    want = [[hf_greedy(hf, list(p), NEW_TOKENS)[0]] for p in PROMPTS]
    jobs = [[Job(p, NEW_TOKENS)] for p in PROMPTS]
    zygote = Zygote(tmp_path)
    co = None
    try:
        a, b = (zygote.start("cpu", model, 0, "--drain-timeout", "30") for _ in range(2))
        co = Coordinator(
            "127.0.0.1", model, "--cpu-server", a.address, "--cpu-server", b.address,
            "--expert-timeout", "5", "--kv-memory", "8MiB",
        )  # fmt: skip
        wait_health(co.addr, "SERVING", timeout=60)
        assert co.servers() == {"cpu0": ("ready", 4), "cpu1": ("ready", 4)}  # 8 experts, once each
        gen = co.placement().generation
        assert through_both([co], jobs) == [want]
        sent: list[float] = []

        def sigterm() -> None:
            sent.append(time.monotonic())
            os.kill(b.pid, signal.SIGTERM)

        got = through_both([co], [js * 3 for js in jobs], at_chunks=len(jobs) * 2, action=sigterm)
        assert got == [[w * 3 for w in want]]  # 0 failed requests, HF's tokens
        wait_for("cpu1 to exit", lambda: not b.alive(), timeout=20)
        assert time.monotonic() - sent[0] < 15  # moved off: no wait for the 30 s drain timeout
        assert "drained: no coordinator stream left" in b.log.read_text()
        assert co.placement().generation == gen + 1
        assert co.servers() == {"cpu0": ("ready", 8), "cpu1": ("unavailable", 0)}
        assert through_both([co], jobs) == [want]
    finally:
        if co is not None:
            co.stop()
        zygote.close()
