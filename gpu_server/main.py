"""``expertmesh gpu-server``: hot experts in GPU memory (Triton kernels on CUDA); runs on the
CPU with ``--device cpu`` (plain torch backend) so the cluster can be tested without a GPU."""

from __future__ import annotations

import argparse

import torch

from expertmesh import cores
from expertmesh.experts import ExpertBackend, TorchExpertBackend
from expertmesh.net import device_uuid
from expertmesh.worker.server import WorkerConfig, serve

DEFAULT_PORT = 50062


def add_arguments(p: argparse.ArgumentParser) -> None:
    WorkerConfig.add_arguments(p, DEFAULT_PORT)
    default = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default, help=f"cuda, cuda:N or cpu (default here: {default})")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def backend_for(device: str) -> ExpertBackend:
    if device.startswith("cuda"):
        from gpu_server.backend import make_backend

        return make_backend(device)
    return TorchExpertBackend()


def run(args: argparse.Namespace) -> int:
    if args.threads:
        cores.set_torch_threads(args.threads)  # intra- and inter-op pools
    config = WorkerConfig.from_args(args, kind="gpu", device=args.device)
    return serve(config, backend_for(args.device), device_uuid(args.device))
