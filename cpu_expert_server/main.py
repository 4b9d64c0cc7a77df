"""``expertmesh cpu-server``: experts in host memory, computed by the CPU backend (backend.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from cpu_expert_server import numa
from cpu_expert_server.backend import make_backend
from cpu_expert_server.packing import WEIGHT_DTYPES
from expertmesh import cores
from expertmesh.worker.server import WorkerConfig, serve

DEFAULT_PORT = 50061


def add_arguments(p: argparse.ArgumentParser) -> None:
    WorkerConfig.add_arguments(p, DEFAULT_PORT)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(  # issue 14h: cpu_expert_server/numa.py
        "--numa-node",
        type=int,
        default=None,
        metavar="K",
        help="run on NUMA node K's CPUs only (threads default to their count), so the experts this "
        "server packs land in K's memory; on a multi-node host run one cpu-server per node",
    )
    p.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default="bfloat16",
        help="expert weights in memory: bfloat16 = unquantised (kept at --dtype); int8/int4 = "
        "quantised at load with group-wise scales (fewer bytes per token, changes results slightly)",
    )


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig.from_args(args, kind="cpu", device="cpu")


def run(args: argparse.Namespace) -> int:
    # NOTE: before make_backend, whose log line says which decode kernel runs (C or the torch
    # fallback); serve() configures the same format again, a no-op then
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # --- issue 14h: NUMA binding before any thread pool starts (threads inherit the mask) ---
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
    # --- end issue 14h ---
    if args.threads:
        cores.set_torch_threads(args.threads)  # intra- and inter-op pools
    return serve(config_from_args(args), make_backend(args.threads, args.weight_dtype))
