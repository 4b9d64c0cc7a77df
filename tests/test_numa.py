"""cpu_expert_server/numa.py against fake sysfs trees (the lent and CI hosts have one node)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from cpu_expert_server import numa
from tests.cluster_utils import ROOT


def fake_sysfs(tmp_path, nodes: dict[int, str]):
    root = tmp_path / "node"
    root.mkdir()
    for nid, cpus in nodes.items():
        (root / f"node{nid}").mkdir()
        (root / f"node{nid}" / "cpulist").write_text(cpus + "\n")
    (root / "possible").write_text("0-3\n")  # not a node directory: ignored
    return root


@pytest.mark.parametrize(
    "text, cpus",
    [("0-3", [0, 1, 2, 3]), ("0-1,8,10-11", [0, 1, 8, 10, 11]), ("5", [5]), ("", []), ("\n", [])],
)
def test_parse_cpulist(text, cpus):
    assert numa.parse_cpulist(text) == cpus
    if cpus:
        assert numa.parse_cpulist(numa.cpulist(tuple(cpus))) == cpus


@pytest.mark.parametrize("bad", ["a-3", "3-1", "1-", "0,,x"])
def test_bad_cpulist_is_an_error(bad):
    with pytest.raises(ValueError, match="cpulist"):
        numa.parse_cpulist(bad)


def test_two_sockets_and_a_memory_only_node(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15", 2: ""})
    nodes = numa.read_nodes(root, allowed=set(range(16)))
    assert nodes == [numa.Node(0, (0, 1, 2, 3, 8, 9, 10, 11)), numa.Node(1, (4, 5, 6, 7, 12, 13, 14, 15))]
    assert "2 NUMA nodes" in numa.describe(nodes) and "--numa-node" in numa.describe(nodes)
    # a cpuset that leaves a node no CPU drops that node; the others keep only allowed CPUs
    assert numa.read_nodes(root, allowed={1, 2, 9}) == [numa.Node(0, (1, 2, 9))]


def test_one_node_and_no_sysfs(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-15"})
    assert numa.read_nodes(root, allowed={0, 1}) == [numa.Node(0, (0, 1))]
    assert "nothing to split" in numa.describe(numa.read_nodes(root, allowed={0, 1}))
    assert numa.read_nodes(tmp_path / "missing", allowed={3, 1}) == [numa.Node(0, (1, 3))]


def test_bind_sets_the_node_cpus(tmp_path, monkeypatch):
    root = fake_sysfs(tmp_path, {0: "0-1", 1: "2-3"})
    monkeypatch.setattr(numa, "allowed_cpus", lambda: {0, 1, 2, 3})
    calls = []
    node = numa.bind_to_node(1, root, setaffinity=lambda pid, cpus: calls.append((pid, cpus)))
    assert node == numa.Node(1, (2, 3)) and calls == [(0, {2, 3})]
    with pytest.raises(ValueError, match="ids \\[0, 1\\]"):
        numa.bind_to_node(7, root, setaffinity=lambda pid, cpus: calls.append((pid, cpus)))
    assert len(calls) == 1


def test_bind_restricts_a_real_process():
    """On this host's real sysfs: a child bound to its first node runs on that node's CPUs only,
    and threads it starts afterwards inherit the mask."""
    first = numa.read_nodes()[0]
    code = (
        "import os, threading; from cpu_expert_server import numa; "
        f"numa.bind_to_node({first.id}); out = []; "
        "t = threading.Thread(target=lambda: out.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join(); "
        "print(sorted(os.sched_getaffinity(0)), out[0])"
    )
    env = _child_env()
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert res.returncode == 0, res.stderr
    cpus = str(list(first.cpus))
    assert res.stdout.strip() == f"{cpus} {cpus}"


def _child_env() -> dict[str, str]:
    """The repo first on the child's path, what this process's path holds kept after it (the
    device machine brings grpc's health/reflection wheels on PYTHONPATH)."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def test_cpu_server_refuses_an_unknown_node(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertmesh.cli",
            "cpu-server",
            "--model",
            str(tmp_path),
            "--numa-node",
            "4096",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_child_env(),
        timeout=120,
    )
    assert res.returncode == 2 and "--numa-node 4096" in res.stderr, res.stderr


# --- one server over several nodes (numa.plan_groups / split_slots, numa_backend) ---


def test_plan_gives_each_node_its_cpus_or_a_share_of_threads(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15", 2: ""})
    nodes = numa.read_nodes(root, allowed=set(range(16)))
    assert numa.plan_groups(nodes) == [
        numa.NodeGroup(0, (0, 1, 2, 3, 8, 9, 10, 11), 8),
        numa.NodeGroup(1, (4, 5, 6, 7, 12, 13, 14, 15), 8),
    ]
    assert [g.threads for g in numa.plan_groups(nodes, 6)] == [3, 3]
    assert [g.threads for g in numa.plan_groups(nodes, 7)] == [4, 3]  # tie: the lower node
    # a cpuset with 6 CPUs on node 0 and 2 on node 1: 1 each, then 3 spare by share 2.25 / 0.75
    lopsided = numa.read_nodes(root, allowed={0, 1, 2, 3, 8, 9, 4, 5})
    assert [(g.node, g.threads) for g in numa.plan_groups(lopsided, 5)] == [(0, 3), (1, 2)]
    assert [g.cpus for g in numa.plan_groups(lopsided, 5)] == [(0, 1, 2, 3, 8, 9), (4, 5)]
    with pytest.raises(ValueError, match="fewer threads than the 2 nodes"):
        numa.plan_groups(nodes, 1)


def test_split_slots_is_contiguous_and_balanced():
    g = [numa.NodeGroup(0, (0,), 4), numa.NodeGroup(1, (1,), 2), numa.NodeGroup(3, (2,), 4)]
    assert numa.split_slots(10, g) == [(0, 4), (4, 7), (7, 10)]  # the spare slot: most threads, lower node
    assert numa.split_slots(11, g) == [(0, 4), (4, 7), (7, 11)]
    assert numa.split_slots(1, g) == [(0, 1), (1, 1), (1, 1)]
    assert numa.split_slots(0, g) == [(0, 0)] * 3
    for s in range(40):
        runs = numa.split_slots(s, g)
        assert runs[0][0] == 0 and runs[-1][1] == s and all(r[1] == n[0] for r, n in zip(runs, runs[1:]))
        sizes = [b - a for a, b in runs]
        assert max(sizes) - min(sizes) <= 1, (s, runs)


def fake_nodes() -> list[numa.Node]:
    """Two "nodes" over this host's CPUs (one each on the 2-core CI machine; a 1-CPU host puts
    both on it): the real multi-group code path on a one-node machine."""
    cpus = sorted(numa.allowed_cpus())
    half = max(1, len(cpus) // 2)
    return [numa.Node(0, tuple(cpus[:half])), numa.Node(1, tuple(cpus[half:] or cpus))]


@pytest.fixture
def numa_backend():
    from cpu_expert_server.numa_backend import NumaExpertBackend

    made = []

    def make(weight_dtype="bfloat16"):
        made.append(NumaExpertBackend(numa.plan_groups(fake_nodes()), weight_dtype))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_group_threads_are_pinned_to_their_node(numa_backend):
    import torch

    before = torch.get_num_threads()
    nb = numa_backend()
    nodes = fake_nodes()
    assert nb.thread_state() == [(list(n.cpus), len(n.cpus)) for n in nodes]
    assert torch.get_num_threads() == before  # the global count is restored
    assert nb.threads == sum(len(n.cpus) for n in nodes)


def packed_layer(backend, s, dtype, seed=0):
    """A random layer's slots packed one by one (as the slot table does), then stacked."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter = 128, 64
    w13 = (torch.randn(s, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(s, h, inter, generator=g) / inter**0.5).to(dtype)
    parts = [backend.pack_weights(w13[i : i + 1], w2[i : i + 1]) for i in range(s)]
    return [p[0][0] for p in parts], [p[1][0] for p in parts]


def close_to(got, want):
    """float32: exact to summation order; bf16: the partial sums round once more (1 ulp)."""
    import torch

    tol = 1e-5 if want.dtype == torch.float32 else 2**-7
    scale = want.float().abs().max().item()
    return (got.float() - want.float()).abs().max().item() <= tol * scale


@pytest.mark.parametrize(
    "dtype, weight_dtype", [("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("bfloat16", "int8")]
)
def test_split_forward_equals_the_plain_backend(numa_backend, dtype, weight_dtype):
    """Decode (T=1, the C kernel) and prefill (T=64: 32 tokens per expert, the GEMM path)."""
    import torch

    from cpu_expert_server.backend import CpuExpertBackend

    dt = getattr(torch, dtype)
    nb, plain = numa_backend(weight_dtype), CpuExpertBackend(2, weight_dtype)
    s, k = 8, 4
    p13, p2 = packed_layer(nb, s, dt)
    w13, w2 = nb.stack_slots(p13, p2)
    ref13, ref2 = packed_layer(plain, s, dt)
    assert torch.equal(w13, torch.stack(ref13)) and torch.equal(w2, torch.stack(ref2))
    g = torch.Generator().manual_seed(1)
    for t in (1, 64):
        x = torch.randn(t, 128, generator=g).to(dt)
        ids = torch.randint(-1, s, (t, k), generator=g)
        wts = torch.rand(t, k, generator=g)
        want = plain.forward(x, w13, w2, ids, wts)
        got = nb.forward(x, w13, w2, ids, wts)
        assert got.dtype == x.dtype and close_to(got, want), (t, (got.float() - want.float()).abs().max())
    # every pair on one node's run: that group's answer alone
    ids = torch.tensor([[0, 1, -1, 2]])
    got = nb.forward(x[:1], w13, w2, ids, wts[:1])
    assert close_to(got, plain.forward(x[:1], w13, w2, ids, wts[:1]))
    with pytest.raises(ValueError, match="slot ids outside"):
        nb.forward(x[:1], w13, w2, torch.tensor([[0, s, -1, 1]]), wts[:1])


def test_split_forward_with_lora(numa_backend):
    import torch

    from cpu_expert_server.backend import CpuExpertBackend
    from expertmesh.lora.moe import LoRABatch, MoELoRAWeights

    nb, plain = numa_backend(), CpuExpertBackend(2)
    s, t, k = 6, 5, 2
    w13, w2 = nb.stack_slots(*packed_layer(nb, s, torch.float32))
    packed_layer(plain, s, torch.float32)  # the plain backend learns the packed format
    g = torch.Generator().manual_seed(2)
    lw = MoELoRAWeights.zeros(2, s, 128, 64, 4, 4, torch.float32, "cpu")
    for buf in (lw.a13, lw.b13, lw.a2, lw.b2):
        buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    lora = LoRABatch(lw, torch.tensor([0, -1, 1, 0, 1]))
    x, ids = torch.randn(t, 128, generator=g), torch.randint(-1, s, (t, k), generator=g)
    wts = torch.rand(t, k, generator=g)
    want = plain.forward(x, w13, w2, ids, wts, lora)
    assert close_to(nb.forward(x, w13, w2, ids, wts, lora), want)
    assert not close_to(nb.forward(x, w13, w2, ids, wts), want)  # the LoRA delta is there


def test_memory_policy_places_or_fails_clearly():
    """The real syscalls on this host: a range preferred on a node this process runs on reads back
    there (or the sandbox refuses the calls, a NumaMemoryError); a node the host lacks is EINVAL."""
    import errno

    import torch

    from cpu_expert_server import numa_memory as nm

    ps = nm.page_size()
    assert nm.inner_pages(ps + 8, 3 * ps) == (2 * ps, 2) and nm.inner_pages(8, 100)[1] == 0
    t = torch.empty(64 * ps, dtype=torch.uint8)
    node = numa.read_nodes()[0].id
    try:
        assert nm.prefer_node(t.data_ptr(), t.numel(), node) in (63, 64)
        t.fill_(1)
        where = nm.where_are(t.data_ptr(), t.numel())
    except nm.NumaMemoryError as e:  # refused by the kernel or sandbox: the documented fallback
        assert e.errno in (errno.EPERM, errno.ENOSYS), e
        return
    assert len(where) in (63, 64) and set(where) == {node}
    assert len(nm.where_are(t.data_ptr(), t.numel(), max_pages=8)) == 8
    with pytest.raises(nm.NumaMemoryError, match="mbind"):
        nm.prefer_node(t.data_ptr(), t.numel(), 4095)


def test_stacking_places_each_run_and_logs_a_refusal(numa_backend, caplog):
    import torch

    nb = numa_backend()
    real = {n.id for n in numa.read_nodes()}
    with caplog.at_level("WARNING", logger="expertmesh.cpu_numa"):
        nb.stack_slots(*packed_layer(nb, 6, torch.float32))  # < MBIND_MIN_BYTES: no mbind
        assert "refused" not in caplog.text
        nb.mbind_min_bytes = 0  # these small tensors too
        nb.stack_slots(*packed_layer(nb, 6, torch.float32))
    for node, (local, total) in nb.placed.items():
        assert total > 0
        if node in real and len(real) == 1:  # the one real node holds everything
            assert local == total, nb.placed
    if 1 not in real:  # fake node 1: mbind refuses it (EINVAL), first touch is the fallback
        assert "NUMA memory policy refused for node 1" in caplog.text
        assert nb.placed[1][0] == 0 and "node 1: 0 of" in caplog.text


def test_a_server_over_two_fake_nodes_across_a_placement_change(tmp_path, numa_backend):
    """The real expert server (start_worker: its slot table stacks through the backend) on the
    fake nodes answers as the plain CPU backend, before and after a pushed placement."""
    import asyncio

    import grpc
    import torch

    from cpu_expert_server.backend import CpuExpertBackend
    from expertmesh.v1 import expert_worker_pb2 as pb
    from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
    from expertmesh.worker.config import WorkerConfig
    from expertmesh.worker.server import start_worker
    from expertmesh.worker_api import ExpertRequest
    from tests.hf_models import make_checkpoint

    make_checkpoint("qwen3_moe", tmp_path)  # 8 experts, H 64, I 32, MoE layers 0 and 2
    nb = numa_backend()
    P = pb.ApplyPlacementRequest

    def request(gen: int, s: int, t: int) -> ExpertRequest:
        g = torch.Generator().manual_seed(t + s)
        ids = torch.randint(-1, s, (t, 2), generator=g, dtype=torch.int32)
        return ExpertRequest(0, gen, 2, torch.randn(t, 64, generator=g), ids, torch.rand(t, 2, generator=g))

    async def main() -> None:
        config = WorkerConfig("cpu", str(tmp_path), port=0, experts="0-6")
        ws = [await start_worker(config, b) for b in (nb, CpuExpertBackend(2))]
        try:
            for w in ws:
                await w.preload
            split, plain = (w.servicer.worker for w in ws)
            assert split.slots.stack == nb.stack_slots
            for gen, s in ((0, 7), (1, 5)):
                if gen:  # reuses 6 and 2, reads 7, drops the rest; 5 slots split 3 + 2
                    layers = [pb.LayerSlots(layer=layer, experts=[6, 2, 7, 0, 1]) for layer in (0, 2)]
                    for w in ws:
                        async with grpc.aio.insecure_channel(f"127.0.0.1:{w.port}") as ch:
                            stub = pb_grpc.ExpertWorkerStub(ch)
                            await stub.ApplyPlacement(P(phase=P.PREPARE, generation=1, layers=layers))
                            await stub.ApplyPlacement(P(phase=P.COMMIT, generation=1))
                assert split.slots.live.layers[2].w13.shape[0] == s and set(nb.placed) == {0, 1}
                for t in (1, 40):
                    req = request(gen, s, t)
                    got = split.compute(split.check(req))
                    assert close_to(got, plain.compute(plain.check(req))), (gen, t)
        finally:
            for w in ws:
                await w.stop(0)

    asyncio.run(main())


def test_cpu_server_numa_node_all(monkeypatch):
    """``--numa-node K|all`` parses; ``all`` on one node is the plain server (None: main.run goes
    on as without the flag), on two the node-split backend; too few threads is an error."""
    import argparse

    import torch

    from cpu_expert_server import main
    from cpu_expert_server.numa_backend import NumaExpertBackend

    p = argparse.ArgumentParser()
    main.add_arguments(p)
    assert p.parse_args(["--model", "m", "--numa-node", "1"]).numa_node == 1
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--numa-node", "any"])
    args = p.parse_args(["--model", "m", "--numa-node", "all"])
    assert args.numa_node == "all"
    assert main.numa_backend_from_args(args, [numa.Node(0, (0, 1))]) is None
    pools = []  # torch's pools are sized once per process: recorded, not resized under pytest
    monkeypatch.setattr(main.cores, "set_torch_threads", pools.append)
    args.threads = 1
    with pytest.raises(ValueError, match="fewer threads than the 2 nodes"):
        main.numa_backend_from_args(args, fake_nodes())
    args.threads = None
    before = torch.get_num_threads()
    b = main.numa_backend_from_args(args, fake_nodes())
    try:
        assert isinstance(b, NumaExpertBackend) and [g.node for g in b.groups] == [0, 1]
        assert pools == [max(len(n.cpus) for n in fake_nodes())]  # one node's share at most
        assert torch.get_num_threads() == before
    finally:
        b.close()


def test_cpu_server_weight_group(monkeypatch, capsys):
    """``--weight-group N|row`` parses, reaches every node's backend, and is refused with
    unquantised weights before anything loads."""
    import argparse

    from cpu_expert_server import main
    from cpu_expert_server.packing import PER_ROW

    p = argparse.ArgumentParser()
    main.add_arguments(p)
    assert p.parse_args(["--model", "m"]).weight_group is None
    assert p.parse_args(["--model", "m", "--weight-group", "128"]).weight_group == 128
    for bad in ("0", "-64", "rows"):
        with pytest.raises(SystemExit):
            p.parse_args(["--model", "m", "--weight-group", bad])
    args = p.parse_args(["--model", "m", "--weight-group", "row"])
    assert args.weight_group == PER_ROW and args.weight_dtype == "bfloat16"
    assert main.run(args) == 2
    assert "--weight-group applies to int8/int4 weights" in capsys.readouterr().err
    args = p.parse_args(["--model", "m", "--weight-dtype", "int4", "--weight-group", "1"])
    assert main.run(args) == 2  # refused before the load would fail on it
    assert "int4 --weight-group must be at least 2" in capsys.readouterr().err
    args = p.parse_args(
        ["--model", "m", "--weight-dtype", "int4", "--weight-group", "row", "--numa-node", "all"]
    )
    monkeypatch.setattr(main.cores, "set_torch_threads", lambda n: None)
    b = main.numa_backend_from_args(args, fake_nodes())
    try:
        assert [g.group for g in b.inner] == [PER_ROW, PER_ROW]
    finally:
        b.close()


def test_kernel_teams_inherit_their_group_pin():
    """The OpenMP teams the groups' kernels start (C decode at T=1, torch GEMMs at T=96) run on
    their group's CPUs only: no thread started by a forward may run on the other node."""
    import torch

    from cpu_expert_server.numa_backend import NumaExpertBackend

    def threads() -> dict[int, tuple[int, ...]]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # exited meanwhile
                out[int(tid)] = tuple(sorted(os.sched_getaffinity(int(tid))))
        return out

    nodes = fake_nodes()
    groups = [numa.NodeGroup(n.id, n.cpus, 2) for n in nodes]  # 2 threads each: a team of 2
    nb = NumaExpertBackend(groups)
    try:
        w13, w2 = nb.stack_slots(*packed_layer(nb, 4, torch.float32))
        before = threads()
        g = torch.Generator().manual_seed(3)
        for t in (1, 96):
            ids = torch.arange(t * 2).reshape(t, 2) % 4
            nb.forward(torch.randn(t, 128, generator=g), w13, w2, ids, torch.rand(t, 2, generator=g))
        started = [a for tid, a in threads().items() if tid not in before]
        assert started and set(started) <= {n.cpus for n in nodes}, started
    finally:
        nb.close()


def test_a_group_error_reaches_the_caller_and_the_next_call_is_clean(numa_backend, monkeypatch):
    import torch

    nb = numa_backend()
    w13, w2 = nb.stack_slots(*packed_layer(nb, 4, torch.float32))
    x, ids, wts = torch.randn(2, 128), torch.tensor([[0, 3], [1, 2]]), torch.rand(2, 2)
    want = nb.forward(x, w13, w2, ids, wts)

    def broken(*args):
        raise RuntimeError("group 1 failed")

    monkeypatch.setattr(nb.inner[1], "forward", broken)
    with pytest.raises(RuntimeError, match="group 1 failed"):
        nb.forward(x, w13, w2, ids, wts)
    monkeypatch.undo()
    assert torch.equal(nb.forward(x, w13, w2, ids, wts), want)  # no stale answer left in a queue


def test_a_group_on_a_cpu_this_process_lacks_is_a_clear_error():
    from cpu_expert_server.numa_backend import GroupThread

    with pytest.raises(OSError):
        GroupThread(numa.NodeGroup(1, (4095,), 1))


# the cpu-server entry point's own steps (main.py), with the node-split backend over fake nodes
SPLIT_SERVER = """
import argparse, sys
from cpu_expert_server import main, numa
from cpu_expert_server.numa_backend import NumaExpertBackend
from expertmesh.worker.server import serve
p = argparse.ArgumentParser()
main.add_arguments(p)
args = p.parse_args(sys.argv[1:])
cpus = sorted(numa.allowed_cpus())
half = max(1, len(cpus) // 2)
nodes = [numa.Node(0, tuple(cpus[:half])), numa.Node(1, tuple(cpus[half:] or cpus))]
sys.exit(serve(main.config_from_args(args), NumaExpertBackend(numa.plan_groups(nodes))))
"""


@pytest.mark.slow
def test_cluster_with_a_split_cpu_server_matches_hf(tmp_path):
    """Coordinator engine + one CPU expert server split over two fake nodes, separate processes
    over loopback gRPC: prefill logits and greedy decode equal HF transformers' (float32), with
    every expert on the split server, then after a placement push that changes its slots."""
    import torch

    from coordinator.experts.remote import ClusterConfig, ServerSpec
    from expertmesh.checkpoint import CheckpointReader
    from tests.cluster_utils import _LISTEN, ServerProc, spawn
    from tests.hf_models import make_checkpoint
    from tests.test_cluster import engine_for
    from tests.test_parity import hf_greedy, rel_err

    hf = make_checkpoint("qwen3_moe", tmp_path)
    cmd = [sys.executable, "-c", SPLIT_SERVER, "--model", str(tmp_path), "--port", "0", "--capacity", "12"]
    proc, lines, m = spawn(cmd, _LISTEN, 120)
    server = ServerProc("cpu", proc, int(m.group(2)), lines)
    try:
        # experts 0-7 on one server: 4 per fake node; then a file placement with 3 replicas of
        # expert 0 (10 slots: 5 + 5) pushed before the second prompt
        ne = CheckpointReader(tmp_path).config.num_experts
        spec = {"servers": ["cpu0"], "layers": {"*": {"cpu0": [0, *range(ne), 0]}}}
        pfile = tmp_path / "placement.json"
        pfile.write_text(__import__("json").dumps(spec))
        servers = (ServerSpec("cpu0", server.address, "cpu"),)
        for cluster in (
            ClusterConfig(servers, num_gpu_experts=0),
            ClusterConfig(servers, placement_file=str(pfile), replica_policy="round_robin"),
        ):
            eng, d = engine_for(tmp_path, cluster)
            try:
                prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
                sid = eng.new_seq()
                full = eng.step([(sid, prompt.tolist())], all_logits=True)[0]
                with torch.no_grad():
                    assert rel_err(full, hf(prompt[None]).logits[0]) < 1e-4
                    ref_toks, ref_logits = hf_greedy(hf, prompt, 4)
                toks, logits = [int(full[-1].argmax())], [full[-1]]
                for _ in range(3):
                    logits.append(eng.step([(sid, [toks[-1]])])[0])
                    toks.append(int(logits[-1].argmax()))
                assert toks == ref_toks and rel_err(torch.stack(logits), ref_logits) < 1e-4
            finally:
                d.close()
        assert "expert pages on their own node" in server.output()  # stacked by the split backend
    finally:
        server.stop()
