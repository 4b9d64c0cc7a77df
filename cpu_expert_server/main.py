"""``expertmesh cpu-server``: experts in host memory, computed with torch on the CPU."""

from __future__ import annotations

import argparse

from expertmesh import cores
from expertmesh.experts import TorchExpertBackend
from expertmesh.worker.server import WorkerConfig, serve

DEFAULT_PORT = 50061


def add_arguments(p: argparse.ArgumentParser) -> None:
    WorkerConfig.add_arguments(p, DEFAULT_PORT)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig.from_args(args, kind="cpu", device="cpu")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        cores.set_torch_threads(args.threads)  # intra- and inter-op pools
    return serve(config_from_args(args), TorchExpertBackend())
