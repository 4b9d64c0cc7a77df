"""``expertmesh cpu-server``: experts in host memory, computed by the CPU backend (backend.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from cpu_expert_server import numa
from cpu_expert_server.backend import make_backend
from cpu_expert_server.kernels import quantise
from cpu_expert_server.numa_backend import make_numa_backend
from cpu_expert_server.packing import PER_ROW, QUANT_DTYPES, WEIGHT_DTYPES
from expertmesh import cores
from expertmesh.experts import ExpertBackend
from expertmesh.worker.server import WorkerConfig, serve

DEFAULT_PORT = 50061


def add_arguments(p: argparse.ArgumentParser) -> None:
    WorkerConfig.add_arguments(p, DEFAULT_PORT)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(  # cpu_expert_server/numa.py; "all"
        "--numa-node",
        type=numa_node_arg,
        default=None,
        metavar="K|all",
        help="K: run on NUMA node K's CPUs only (threads default to their count), so the experts "
        "this server packs land in K's memory (one cpu-server per node); all: one server over every "
        "node, each node's share of the experts in its memory and computed by its own threads "
        "(--threads is then the total, shared by the nodes); on one node both change nothing",
    )
    p.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default="bfloat16",
        help="expert weights in memory: bfloat16 = unquantised (kept at --dtype); int8/int4 = "
        "quantised at load with group-wise scales (fewer bytes per token, changes results slightly)",
    )
    p.add_argument(
        "--weight-group",
        type=weight_group_arg,
        default=None,
        metavar="N|row",
        help="int8/int4 quantisation group: a scale per N input features (the largest group <= N "
        "that divides each width; default 128 for int8, 64 for int4), or row: one scale per row "
        "(fewer bytes and faster prefill, less accurate where a row holds outliers)",
    )


def weight_group_arg(text: str) -> int:
    """``--weight-group``: a positive group size, or ``row`` (packing.PER_ROW)."""
    if text == "row":
        return PER_ROW
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a group size (64, 128, ...) or 'row', got {text!r}")
    return int(text)


def numa_node_arg(text: str) -> int | str:
    """``--numa-node``: a node id, or ``all``."""
    if text == "all":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a node id (0, 1, ...) or 'all', got {text!r}")
    return int(text)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig.from_args(args, kind="cpu", device="cpu")


def run(args: argparse.Namespace) -> int:
    # NOTE: before make_backend, whose log line says which decode kernel runs (C or the torch
    # fallback); serve() configures the same format again, a no-op then
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.weight_group is not None and args.weight_dtype not in QUANT_DTYPES:
        print(f"error: --weight-group applies to int8/int4 weights, not {args.weight_dtype}", file=sys.stderr)
        return 2
    if args.weight_dtype == "int4" and args.weight_group == 1:  # int4 groups pair their halves up
        print("error: int4 --weight-group must be at least 2 (or row)", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ValueError as e:  # a bad flag (or EXPERTMESH_LINK): say which, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.weight_dtype in QUANT_DTYPES:
        # NOTE: where the cache holds no build, the quantiser compiles beside the decode
        # kernels (make_backend) instead of stalling the load's first reads behind its lock
        threading.Thread(target=quantise.load, name="quantiser-build", daemon=True).start()
    # --- one server over every node (cpu_expert_server/numa_backend.py) ---
    if args.numa_node == "all":
        try:
            backend = numa_backend_from_args(args, numa.read_nodes())
        except (ValueError, OSError) as e:  # too few threads; a group's CPUs refused (sched_setaffinity)
            print(f"error: {e}", file=sys.stderr)
            return 2
        if backend is not None:
            return serve(config, backend)
        args.numa_node = None  # one node: exactly the server without the flag
    # --- NUMA binding before any thread pool starts (threads inherit the mask) ---
    if args.numa_node is not None:
        try:
            node = numa.bind_to_node(args.numa_node)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        args.threads = args.threads or len(node.cpus)
        print(f"NUMA node {node.id}: {len(node.cpus)} CPUs, {args.threads} threads", flush=True)
    else:
        print(f"NUMA: {numa.describe(numa.read_nodes())}", flush=True)
    if args.threads:
        cores.set_torch_threads(args.threads)  # intra- and inter-op pools
    return serve(config, make_backend(args.threads, args.weight_dtype, args.weight_group))


def numa_backend_from_args(args: argparse.Namespace, nodes: list[numa.Node]) -> ExpertBackend | None:
    """``--numa-node all``: the node-split backend over ``nodes``, or None for one
    node (the plain backend then, unchanged). ValueError for a ``--threads`` below the nodes."""
    if len(nodes) == 1:
        print("NUMA: --numa-node all on one node: the plain server", flush=True)
        return None
    groups = numa.plan_groups(nodes, args.threads)
    # torch work outside the groups (and the groups' MKL, whose count is process-wide) gets at
    # most one node's share
    cores.set_torch_threads(max(g.threads for g in groups))
    print(
        f"NUMA: one server over {len(groups)} nodes: "
        + "; ".join(f"node {g.node}: {g.threads} threads on CPUs {numa.cpulist(g.cpus)}" for g in groups),
        flush=True,
    )
    return make_numa_backend(groups, args.weight_dtype, args.weight_group)
