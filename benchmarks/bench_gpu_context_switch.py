"""What it costs two processes to take turns on one GPU, with no transport at all.

    python3 benchmarks/bench_gpu_context_switch.py [--rounds 400]

The coordinator and a co-located GPU expert server are two processes, so two CUDA contexts;
without MPS the GPU runs one context at a time. Here two processes ping-pong through a pipe,
and on each turn run one tiny GPU operation on their own context and synchronise: nothing,
a device-to-device copy, a kernel, or a device-to-host copy. The difference to 'none' is what
handing the GPU from one process to the other costs, a floor under any same-GPU fast path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

OPS = ("none", "d2d", "kernel", "d2h")


def turn(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if op == "none":
        return
    if op == "d2d":
        b.copy_(a)
    elif op == "kernel":
        torch.add(a, 1, out=b)
    else:
        b.cpu()
    torch.cuda.synchronize()


def child(op: str) -> None:
    a = torch.ones(1024, device="cuda")
    b = torch.empty_like(a)
    sys.stdout.buffer.write(b"r")
    sys.stdout.flush()
    while sys.stdin.buffer.read(1) == b"x":
        turn(op, a, b)
        sys.stdout.buffer.write(b"x")
        sys.stdout.flush()


def measure(rounds: int = 400, ops: tuple[str, ...] = OPS, device: int = 0) -> dict[str, float]:
    """Median microseconds per round for each ``op`` (the child runs on the same GPU)."""
    torch.cuda.set_device(device)
    a = torch.ones(1024, device="cuda")
    b = torch.empty_like(a)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(device)) if device else None
    out = {}
    for op in ops:
        p = subprocess.Popen(
            [sys.executable, __file__, "_child", op],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        assert p.stdin is not None and p.stdout is not None
        p.stdout.read(1)
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            turn(op, a, b)
            p.stdin.write(b"x")
            p.stdout.read(1)
            ts.append(time.perf_counter() - t0)
        p.stdin.close()
        p.wait()
        out[op] = statistics.median(ts[rounds // 8 :]) * 1e6
    return out


def main() -> None:
    if sys.argv[1:2] == ["_child"]:
        return child(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    print("| each turn (both processes) | us per round (median) |\n|---|---|")
    for op, us in measure(args.rounds).items():
        print(f"| {op} + synchronize | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
