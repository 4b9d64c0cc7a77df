"""Two coordinators sharing one pool of expert servers (``--placement-lease``), as processes,
each role on its own loopback address: coordinators on 127.0.0.2 and 127.0.0.3, a GPU expert
server (on the CPU) on 127.0.0.4 and a CPU expert server on 127.0.0.5.

- concurrent streams through both coordinators give HF's greedy tokens, before and after a
  rebalance;
- both report the same placement generation and the same placement holder (one of them);
- a rebalance by the holder is followed by the other, plans with the tokens routed through
  both (the servers' counts), and the follower may not rebalance;
- an adapter loaded through one coordinator is usable through the other;
- an expert server restarted on its port gets the placement and the adapter from the holder,
  and both coordinators serve through it again;
- three rebalances by the holder while the follower streams cost the follower no request
  (its steps refused for the generation it has not adopted yet run again once it has);
- kill -9 of the holder: the other takes the role within the lease and keeps serving.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from expertmesh.v1 import admin_pb2, admin_pb2_grpc
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from tests import lora_utils
from tests.cluster_utils import spawn
from tests.fault_utils import Job, Zygote, run_load, wait_health
from tests.serving_utils import hf_greedy

pytestmark = pytest.mark.slow

LEASE_S = 2.0
NEW_TOKENS = 5
PROMPTS = [tuple((11 * i + j * 5) % 90 + 2 for j in range(3 + i % 3)) for i in range(6)]
COORD_HOSTS = ("127.0.0.2", "127.0.0.3")
GPU_HOST, CPU_HOST = "127.0.0.4", "127.0.0.5"


class Coordinator:
    def __init__(self, host: str, model: Path, *flags: str) -> None:
        cmd = [sys.executable, "-m", "expertmesh.cli", "coordinator", "--model", str(model)]
        cmd += ["--host", host, "--port", "0", "--threads", "1", *flags]
        self.proc, self.lines, m = spawn(cmd, re.compile(r"coordinator listening on (\S+):(\d+)"), 120)
        self.addr = f"{host}:{m.group(2)}"

    def admin(self):
        return grpc.insecure_channel(self.addr)

    def placement(self) -> admin_pb2.PlacementInfo:
        with self.admin() as ch:
            return admin_pb2_grpc.AdminStub(ch).GetPlacement(admin_pb2.GetPlacementRequest(), timeout=10)

    def rebalance(self, dry_run: bool = False) -> admin_pb2.RebalanceOutcome:
        with self.admin() as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            return stub.Rebalance(admin_pb2.RebalanceRequest(dry_run=dry_run), timeout=60).outcome

    def routed(self) -> int:
        """(token, expert) pairs this coordinator routed since start, over all MoE layers."""
        with self.admin() as ch:
            load = admin_pb2_grpc.AdminStub(ch).GetExpertLoad(admin_pb2.GetExpertLoadRequest(), timeout=10)
        return sum(sum(layer.tokens) for layer in load.layers)

    def states(self) -> list[str]:
        with self.admin() as ch:
            resp = admin_pb2_grpc.AdminStub(ch).ListServers(admin_pb2.ListServersRequest(), timeout=10)
        return [s.state for s in resp.servers]

    def transports(self) -> list[str]:
        with self.admin() as ch:
            resp = admin_pb2_grpc.AdminStub(ch).ListServers(admin_pb2.ListServersRequest(), timeout=10)
        return [s.transport for s in resp.servers]

    def load_lora(self, name: str, path: Path) -> None:
        with self.admin() as ch:
            admin_pb2_grpc.AdminStub(ch).LoadLoRA(
                admin_pb2.LoadLoRARequest(name=name, path=str(path)), timeout=60
            )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:  # noqa: BLE001 - a stuck one is killed
                self.kill()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    hf = lora_utils.make_model("qwen2_moe", root / "model")
    want = [hf_greedy(hf, list(p), NEW_TOKENS)[0] for p in PROMPTS]  # NOTE: before wrap() adds LoRA to hf
    lora_utils.save(lora_utils.wrap(hf, seed=5), root / "adapters" / "a")
    return root, want


def both(coords: list[Coordinator], jobs: list[list[Job]]) -> list[list[list[int]]]:
    """The same clients through every coordinator at once; each one's tokens (errors fail)."""
    results: list = [None] * len(coords)

    def run(i: int) -> None:
        results[i] = run_load(coords[i].addr, jobs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(coords))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    out = []
    for c, res in zip(coords, results):
        assert res is not None, f"{c.addr}: the load did not finish"
        for outs in res:
            for o in outs:
                assert o.error is None, f"{c.addr}: {o.error}"
        out.append([[o.tokens for o in outs] for outs in res])
    return out


def wait_for(what: str, fn, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"waited {timeout}s for {what}"
        time.sleep(0.1)


def test_two_coordinators_share_one_expert_pool(model):
    root, want = model
    mdir = root / "model"
    jobs = [[Job(p, NEW_TOKENS)] for p in PROMPTS]
    zygote = Zygote(root)
    coords: list[Coordinator] = []
    try:
        # NOTE: the GPU server batches the two coordinators' waiting requests, the CPU one does not
        gpu = zygote.start("gpu", mdir, 0, "--host", GPU_HOST, "--combine-streams")
        cpu = zygote.start("cpu", mdir, 0, "--host", CPU_HOST)
        flags = [
            "--gpu-server", f"{GPU_HOST}:{gpu.port}", "--cpu-server", f"{CPU_HOST}:{cpu.port}",
            "--placement-lease", str(LEASE_S), "--expert-timeout", "5", "--connect-timeout", "5",
            "--lora-dir", str(root / "adapters"), "--max-loras", "2",
            "--page-size", "4", "--kv-memory", "8MiB",
            # NOTE: the shared-memory path (one channel per coordinator on each server)
            "--transport", "shm", "--shm-ring-mb", "4",
        ]  # fmt: skip
        coords = [Coordinator(h, mdir, *flags) for h in COORD_HOSTS]
        for c in coords:
            wait_health(c.addr, "SERVING", timeout=60)

        # one holder, the same placement on both
        def agreed():
            ps = [c.placement() for c in coords]
            same = len({(p.generation, p.placement_holder) for p in ps}) == 1
            return ps if same and ps[0].placement_holder else None

        ps = wait_for("one placement holder and generation on both", agreed)
        ids = [p.coordinator_id for p in ps]
        assert ps[0].placement_holder in ids and len(set(ids)) == 2
        holder = coords[ids.index(ps[0].placement_holder)]
        follower = coords[1 - coords.index(holder)]
        gen = ps[0].generation

        assert both(coords, jobs) == [[[w] for w in want]] * 2
        assert [c.transports() for c in coords] == [["shm", "shm"]] * 2

        # the follower may not rebalance; the holder's rebalance is followed by the follower
        refused = follower.rebalance()
        assert refused.outcome == "failed" and "holds the placement role" in refused.error, refused
        out = holder.rebalance()
        assert out.outcome == "rebalanced", out
        assert out.generation == gen + 1
        wait_for("the follower at the new generation", lambda: follower.placement().generation == gen + 1)

        # the next plan counts the tokens routed through both coordinators since that push
        before = [c.routed() for c in coords]
        assert both(coords, jobs) == [[[w] for w in want]] * 2
        routed = [c.routed() - b for c, b in zip(coords, before)]
        assert all(r > 0 for r in routed), routed
        plan = holder.rebalance(dry_run=True)
        assert plan.load_source == "servers", plan
        assert plan.window_tokens == sum(routed), (plan.window_tokens, routed)

        # an adapter loaded through the follower is usable through the holder (same tokens)
        follower.load_lora("a", root / "adapters" / "a")
        ad = [[Job(p, NEW_TOKENS, "a")] for p in PROMPTS[:3]]
        via_follower = both([follower], ad)[0]
        assert via_follower != [[w] for w in want[:3]]  # the adapter changes tokens
        wait_for("the adapter on the holder", lambda: _lora_runs(holder, ad))
        assert both([holder], ad)[0] == via_follower

        # an expert server restarts on its port: the holder pushes it the live placement and the
        # adapter (learned from the servers), the follower waits for that; then both serve as before
        live = holder.placement().generation
        cpu.kill()
        cpu = zygote.start("cpu", mdir, cpu.port, "--host", CPU_HOST)
        wait_for(
            "the restarted server at the live generation", lambda: _generation(CPU_HOST, cpu.port) == live
        )
        wait_for("both coordinators ready", lambda: all(c.states() == ["ready", "ready"] for c in coords))
        assert both(coords, jobs) == [[[w] for w in want]] * 2
        assert both(coords, ad) == [via_follower] * 2

        # the holder rebalances while the follower streams: a follower step refused for the
        # generation it has not adopted yet runs again once it has, and no follower request fails
        longer = [[Job(p, 48), Job(p, 48)] for p in PROMPTS]
        ref = both([follower], longer)[0]
        pushes: list = []

        def push() -> None:
            for _ in range(3):
                pushes.append(holder.rebalance())

        pusher = threading.Thread(target=push)
        res = run_load(follower.addr, longer, at_chunks=len(PROMPTS), action=pusher.start)
        pusher.join(120)
        assert [o.outcome for o in pushes] == ["rebalanced"] * 3, pushes
        assert [[o.tokens for o in outs] for outs in res] == ref, [o.error for outs in res for o in outs]
        retried = sum("refused for its placement generation" in line for line in follower.lines)
        print(f"follower steps run again after a stale refusal: {retried}")

        # kill -9 of the holder while the follower streams: the follower's requests all finish
        # (a coordinator that dies loses only its own), it takes the role and keeps serving
        t0 = [0.0]

        def kill_holder() -> None:
            holder.kill()
            t0[0] = time.monotonic()

        res = run_load(follower.addr, [js * 2 for js in jobs], at_chunks=len(jobs) * 2, action=kill_holder)
        assert [[o.tokens for o in outs] for outs in res] == [[w, w] for w in want], [
            o.error for outs in res for o in outs
        ]
        p = wait_for(
            "the follower holding the role",
            lambda: (q := follower.placement()).placement_holder == q.coordinator_id and q,
            timeout=LEASE_S * 5 + 10,
        )
        took = time.monotonic() - t0[0]
        assert both([follower], jobs)[0] == [[w] for w in want]
        out = follower.rebalance()
        assert out.outcome == "rebalanced" and out.generation > p.generation, out
        assert both([follower], jobs)[0] == [[w] for w in want]
        print(f"the follower took the placement role {took:.1f}s after kill -9 of the holder")
    finally:
        for c in coords:
            c.stop()
        zygote.close()


def _generation(host: str, port: int) -> int:
    with grpc.insecure_channel(f"{host}:{port}") as ch:
        return int(pb_grpc.ExpertWorkerStub(ch).Describe(pb.DescribeRequest(), timeout=10).generation)


def _lora_runs(c: Coordinator, jobs: list[list[Job]]) -> bool:
    res = run_load(c.addr, jobs)
    return all(o.error is None for outs in res for o in outs)
