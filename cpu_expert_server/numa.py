"""NUMA: the host's nodes, and binding a CPU expert server to one of them.

On a host with several NUMA nodes a core reads its own node's DRAM at full speed and the other
nodes' across the socket link at a fraction of it; a bandwidth-bound decode kernel whose threads
read weights from another node loses that fraction. The layout this module supports: one CPU
expert server per node, started with ``cpu-server --numa-node K``, each listed to the
coordinator (``--cpu-server`` per node). Then:

- experts: the coordinator's static split gives each CPU server a contiguous run of the CPU
  experts (expertmesh/placement.py ``static_split``), EPLB balances them by load, so each
  node holds its own share;
- threads: :func:`bind_to_node` restricts the whole server process to node K's CPUs before any
  thread pool starts, so every compute thread (torch's, the kernel's OpenMP team) runs there;
- memory: Linux's default policy allocates a page on the node of the CPU that first touches it;
  the server packs its experts' weights (cpu_expert_server/packing.py) with threads that all run
  on node K, so the packed copies, the bytes decode reads, are node-local (first touch). The
  checkpoint's page cache (read once at load) may be anywhere: it is not on the decode path.

On a one-node host all of this is a no-op (``--numa-node 0`` binds to the CPUs the process had).

The other layout: ONE server over every node, ``cpu-server --numa-node all``
(cpu_expert_server/numa_backend.py). :func:`plan_groups` gives each node a group of compute
threads (its allowed CPUs, or its share of ``--threads``) and :func:`split_slots` gives each group
a contiguous run of every layer's slots, balanced by bytes; each run's weights live in its node's
memory and are computed by its group. It keeps one server's placement and connection per host
but cannot balance load between the nodes (the coordinator's EPLB balances servers, not nodes).

Sysfs: ``/sys/devices/system/node/node<K>/cpulist`` lists node K's CPUs (``0-7,16-23``); nodes
with memory but no CPUs have an empty list and are skipped.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SYSFS_NODES = "/sys/devices/system/node"
_NODE_DIR = re.compile(r"^node(\d+)$")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Node:
    id: int
    cpus: tuple[int, ...]  # the CPUs this process may use on the node, ascending


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"not a cpulist: {text!r}")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"not a cpulist (range {part} runs backwards): {text!r}")
        cpus.extend(range(a, b + 1))
    return cpus


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (taskset, cgroup cpusets, container limits)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def read_nodes(root: str | Path = SYSFS_NODES, allowed: set[int] | None = None) -> list[Node]:
    """The host's NUMA nodes with at least one CPU this process may use, by id. A host without
    the sysfs tree (not Linux, some containers) reads as one node holding every allowed CPU."""
    allowed = allowed_cpus() if allowed is None else allowed
    root = Path(root)
    nodes = []
    if root.is_dir():
        for d in root.iterdir():
            m = _NODE_DIR.match(d.name)
            if m is None or not (d / "cpulist").is_file():
                continue
            cpus = tuple(c for c in parse_cpulist((d / "cpulist").read_text()) if c in allowed)
            if cpus:
                nodes.append(Node(int(m.group(1)), cpus))
    if not nodes:
        return [Node(0, tuple(sorted(allowed)))]
    return sorted(nodes, key=lambda n: n.id)


def describe(nodes: list[Node]) -> str:
    parts = [f"node {n.id}: {len(n.cpus)} CPUs" for n in nodes]
    if len(nodes) == 1:
        return f"1 NUMA node ({parts[0]}): nothing to split"
    return (
        f"{len(nodes)} NUMA nodes ({'; '.join(parts)}): run one cpu-server per node with "
        "--numa-node K and give each to the coordinator as --cpu-server, or one server over all "
        "of them with --numa-node all"
    )


@dataclass(frozen=True)
class NodeGroup:
    """The compute threads of one node in a server that spans several (``--numa-node all``)."""

    node: int
    cpus: tuple[int, ...]  # the thread group runs on these only
    threads: int  # the kernels' thread count for this group's experts

    def __post_init__(self) -> None:
        assert self.cpus and self.threads >= 1, f"{self}"


def plan_groups(nodes: list[Node], threads: int | None = None) -> list[NodeGroup]:
    """One thread group per node. ``threads=None``: each node's allowed CPUs (the groups run
    concurrently, so that is every allowed CPU once: no oversubscription); else ``threads``
    shared in proportion to the nodes' CPU counts (largest remainder, ties to the lower node),
    at least one per node. Raises ValueError when ``threads`` is fewer than the nodes."""
    if threads is None:
        return [NodeGroup(n.id, n.cpus, len(n.cpus)) for n in nodes]
    if threads < len(nodes):
        raise ValueError(
            f"--threads {threads} with --numa-node all: fewer threads than the {len(nodes)} nodes "
            f"({describe(nodes)}); give at least one per node, or bind to one node"
        )
    total = sum(len(n.cpus) for n in nodes)
    # one thread each first, the rest by CPU share
    spare = threads - len(nodes)
    exact = [spare * len(n.cpus) / total for n in nodes]
    share = [int(e) for e in exact]
    by_remainder = sorted(range(len(nodes)), key=lambda i: (-(exact[i] - share[i]), i))
    for i in by_remainder[: spare - sum(share)]:
        share[i] += 1
    return [NodeGroup(n.id, n.cpus, 1 + s) for n, s in zip(nodes, share, strict=True)]


def split_slots(num_slots: int, groups: list[NodeGroup]) -> list[tuple[int, int]]:
    """A layer's slots ``0..S-1`` -> one contiguous ``[a, b)`` per group, in group order.

    Balanced by bytes: every slot of a layer holds the same number of bytes, so the counts differ
    by at most one, the spare slots going to the groups with more threads (ties: lower node).
    Contiguous, so each group's experts are a view of the layer's stacked tensors (the kernels
    take a base pointer and a slot count) and one memory range per node. A pure function of S:
    the slot table's stacking and every forward agree on it without sharing state."""
    assert num_slots >= 0 and groups, f"{num_slots=} {groups=}"
    base, spare = divmod(num_slots, len(groups))
    first = sorted(range(len(groups)), key=lambda i: (-groups[i].threads, groups[i].node))[:spare]
    out, a = [], 0
    for i in range(len(groups)):
        b = a + base + (i in first)
        out.append((a, b))
        a = b
    return out


def bind_to_node(
    node_id: int,
    root: str | Path = SYSFS_NODES,
    setaffinity: Callable[[int, set[int]], None] | None = None,
) -> Node:
    """Restricts this process to node ``node_id``'s CPUs. Call it at start, before any thread
    pool exists: threads created later inherit the mask (threads already running keep theirs).
    Raises ValueError naming the nodes there are when ``node_id`` is not one of them."""
    nodes = read_nodes(root)
    node = next((n for n in nodes if n.id == node_id), None)
    if node is None:
        raise ValueError(
            f"--numa-node {node_id}: this host has {describe(nodes)}; ids {[n.id for n in nodes]}"
        )
    (setaffinity or os.sched_setaffinity)(0, set(node.cpus))
    log.info("bound to NUMA node %d: CPUs %s (%s)", node.id, cpulist(node.cpus), describe(nodes))
    return node


def cpulist(cpus: tuple[int, ...]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the cpulist format back)."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
