"""Load speed of each process from a warm page cache: GB/s of checkpoint bytes read.

Each path runs in a fresh child process (its own threads, allocator and page tables, as a
server has) and times only the load itself, as the process runs it:

- ``coordinator``: the non-expert weights (``load_model``) onto ``--device``;
- ``inproc``: the coordinator's own experts when it has no expert servers (``LocalDispatcher``);
- ``gpu``: an expert server's slot table on ``--device`` with the GPU backend (Triton on CUDA,
  the plain torch backend and the same direct reads elsewhere), every expert preloaded;
- ``cpu_bf16`` / ``cpu_int4`` / ``cpu_int8``: the CPU server's slot table and packing.

GB/s = checkpoint bytes the path reads / seconds; also GB per CPU second and minor page faults
per GB (each a fresh 4 KB page written: counts that a busy or small host does not blur). The checkpoint is ``--model`` or a random
Qwen3-30B-A3B written to ``--dir`` (benchmarks/fullsize_ckpt.py; ``--layers``/``--experts``
shrink it; the full 48 x 128 is 61 GB). ``--threads`` caps the child's torch threads (a CPU
server's ``--threads``). Runs anywhere; the device command is in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from expertmesh.experts import ExpertBackend

ROOT = Path(__file__).resolve().parents[1]
# NOTE: appended, so a PYTHONPATH naming another checkout (a before/after run) takes precedence
sys.path += [str(ROOT), str(ROOT / "benchmarks")]

PATHS = ("coordinator", "inproc", "gpu", "cpu_bf16", "cpu_int4", "cpu_int8")
GB = 1e9


def warm_page_cache(model: Path) -> int:
    """Reads every shard once; returns the bytes read."""
    n = 0
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return n


def _timed(fn: Callable[[], object], dev: torch.device) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of every thread, minor page faults) of ``fn``, finished on
    ``dev``."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    secs, cpu = time.perf_counter() - w0, time.process_time() - c0
    return secs, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def _load(path: str, model: Path, device: str, dtype: torch.dtype) -> dict:
    """Runs one load in this process, timed from its start as the process runs it."""
    from expertmesh.checkpoint import CheckpointReader

    reader = CheckpointReader(model)
    cfg = reader.config
    # NOTE: a CPU server's slots are host memory whatever --device says (the GPU paths' device)
    dev = torch.device("cpu" if path.startswith("cpu_") else device)
    if dev.type == "cuda":
        torch.empty(1, device=dev)  # the CUDA context exists before the clock starts, as in a server
    nbytes = reader.expert_nbytes() * cfg.num_experts * len(cfg.moe_layer_ids)
    if path == "coordinator":
        from coordinator.model.loader import load_model

        nbytes = sum(reader.nbytes(n) for n in reader.non_expert_names())
        note = f"non-expert weights in {dtype}"
        secs, cpu, faults = _timed(lambda: load_model(reader, dtype, dev), dev)
    elif path == "inproc":
        from coordinator.model.dispatch import LocalDispatcher
        from expertmesh.experts import TorchExpertBackend

        note = "every expert, stacked per layer"
        secs, cpu, faults = _timed(lambda: LocalDispatcher(reader, dtype, dev, TorchExpertBackend()), dev)
    else:
        from expertmesh.worker.server import slot_table

        backend: ExpertBackend
        if path == "gpu":
            from gpu_server.backend import make_backend as gpu_backend

            backend = gpu_backend(device)
            note = f"{backend.name} backend on {device}"
        else:
            from cpu_expert_server.backend import make_backend as cpu_backend

            wdtype = {"cpu_bf16": "bfloat16", "cpu_int4": "int4", "cpu_int8": "int8"}[path]
            backend = cpu_backend(torch.get_num_threads(), wdtype)
            note = f"weights {wdtype}, {torch.get_num_threads()} threads"
        table = slot_table(reader, backend, dtype, dev, cfg.num_experts)
        secs, cpu, faults = _timed(lambda: table.preload(list(range(cfg.num_experts))), dev)
    gb = nbytes / GB
    return dict(
        path=path,
        seconds=secs,
        gb=gb,
        gb_per_s=gb / secs,
        cpu_s=cpu,
        gb_per_cpu_s=gb / cpu,
        faults_per_gb=faults / gb,
        note=note,
    )


def _child(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    row = _load(args.child, args.model, args.device, getattr(torch, args.dtype))
    print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="use this checkpoint (default: write one)")
    p.add_argument("--dir", type=Path, default=Path("/tmp/expertmesh-bench-load"))
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--paths", default="coordinator,gpu,cpu_bf16,cpu_int4")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's)")
    p.add_argument("--repeat", type=int, default=1, help="runs per path (the best is reported)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    if args.model is None:
        from fullsize_ckpt import write_checkpoint

        over = dict(num_hidden_layers=args.layers, max_window_layers=args.layers, experts=args.experts)
        write_checkpoint("qwen3-30b-a3b", args.dir, over, args.device)
        args.model = args.dir
    t0 = time.perf_counter()
    n = warm_page_cache(args.model)
    print(f"checkpoint {args.model}: {n / GB:.2f} GB, read in {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    for path in args.paths.split(","):
        assert path in PATHS, f"{path=} not in {PATHS}"
        best: dict | None = None
        for _ in range(args.repeat):
            cmd = [sys.executable, __file__, "--child", path, "--model", str(args.model)]
            cmd += ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
            got = [json.loads(ln[4:]) for ln in out.stdout.splitlines() if ln.startswith("ROW ")]
            if out.returncode or not got:
                raise RuntimeError(f"{path} failed:\n{out.stdout}\n{out.stderr}")
            if best is None or got[0]["gb_per_s"] > best["gb_per_s"]:
                best = got[0]
        assert best is not None
        rows.append(best)
        print(
            f"{path:12s} {best['gb']:7.2f} GB in {best['seconds']:6.2f}s: {best['gb_per_s']:6.2f} GB/s"
            f" ({best['gb_per_cpu_s']:.2f} GB per CPU second, {best['faults_per_gb']:.0f} minor faults"
            f" per GB; {best['note']})",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
