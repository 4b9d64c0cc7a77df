"""``expertmesh gpu-server``: hot experts in GPU memory (Triton kernels on CUDA); runs on the
CPU with ``--device cpu`` (plain torch backend) so the cluster can be tested without a GPU."""

from __future__ import annotations

import argparse
import sys

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
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run decode-sized requests eagerly (default on CUDA: one graph per layer and token bucket)",
    )


def backend_for(device: str, model_dir: str = "", cuda_graphs: bool = True) -> ExpertBackend:
    if device.startswith("cuda"):
        from gpu_server.backend import TritonExpertBackend, make_backend
        from gpu_server.fp8_backend import fp8_backend_for
        from gpu_server.graphs import GraphedBackend

        # FP8 block-quantised experts stay FP8 on a GPU that computes in FP8
        fp8 = fp8_backend_for(model_dir, device) if model_dir else None
        if fp8 is not None:
            return fp8
        backend = make_backend(device)
        if cuda_graphs and isinstance(backend, TritonExpertBackend):
            return GraphedBackend(backend)  # decode-sized requests: one launch (gpu_server/graphs.py)
        return backend
    return TorchExpertBackend()


def run(args: argparse.Namespace) -> int:
    if args.threads:
        cores.set_torch_threads(args.threads)  # intra- and inter-op pools
    try:
        config = WorkerConfig.from_args(args, kind="gpu", device=args.device)
    except ValueError as e:  # a bad flag (or EXPERTMESH_LINK): say which, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    backend = backend_for(args.device, args.model, cuda_graphs=not args.no_cuda_graphs)
    return serve(config, backend, device_uuid(args.device))
