"""cpu_expert_server/numa.py against fake sysfs trees (the lent and CI hosts have one node)."""

from __future__ import annotations

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
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert res.returncode == 0, res.stderr
    cpus = str(list(first.cpus))
    assert res.stdout.strip() == f"{cpus} {cpus}"


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
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert res.returncode == 2 and "--numa-node 4096" in res.stderr, res.stderr
