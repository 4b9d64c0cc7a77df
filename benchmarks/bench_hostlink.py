"""The host link (cpu_expert_server/hostlink.py) at real widths, in ONE process: a real
ShmClient offering it and a real CPU worker behind a real ShmServer accepting it; this script
plays the coordinator's linked graph (per MoE layer: write the request into the segment, bump
the request flag, spin on the answer flag) in Python.

Columns (per MoE layer, microseconds, over the timed steps):
- ``round trip p50/p90``: from our request flag's store to the answer flag seen (the C thread's
  wake-up from its spin, the routing copy and check, the kernel, the answer);
- ``kernel``: the C thread's own time per layer (routing copy + kernel), its mean over a step,
  median over the steps;
- ``link cost``: round trip p50 - kernel (what the hand-over adds to the kernel; noise can
  make it negative on a busy host);
- ``forward_into``: the backend's ``forward_into`` called from Python on the same inputs (the
  kernel behind the per-layer Python of today's fast path; ``forward`` where it declines the
  call, as bf16 on a CPU without AMX);
- ``shm path``: today's fast path for the same layer (ShmClient.send + result: descriptor,
  FIFO, the server's Python decode and checks, the kernel, the answer).
Plus ``launch``: a LinkStep's answer (once per decode step, on the coordinator's critical path).

The coordinator's GPU reads and writes these areas over PCIe in the real thing; here its
stand-in is Python on this host (a store and a spin), so the round trip is the server's side
plus a core-to-core cache line hand-over each way.

``python3 benchmarks/bench_hostlink.py [--threads N] [--layers 8] [--batches 1 8]
[--weights int4 bfloat16]``; Qwen3-30B-A3B widths by default (H 2048, I 768, 128 experts,
top-8). ``--layers`` distinct layers of random weights (8 x 128 experts of bf16 are ~9.7 GB:
distinct layers keep the weights out of the last-level cache, as 48 layers would).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from cpu_expert_server.backend import CpuExpertBackend
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import link_layout as ll
from expertmesh.transport.client import ShmClient
from expertmesh.transport.handshake import Hello
from expertmesh.transport.server import ShmServer
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.server import slot_table
from expertmesh.worker_api import ExpertRequest

DT = torch.bfloat16
CPU = torch.device("cpu")


class RandomReader:
    """A checkpoint of ``layers`` MoE layers of random experts (seeded by layer and expert)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.h, self.i = a.hidden, a.inter
        self.config = SimpleNamespace(
            hidden_size=a.hidden,
            moe_intermediate_size=a.inter,
            moe_layer_ids=list(range(a.layers)),
            num_experts=a.experts,
            model_type="bench",
        )

    def expert_weights(self, layer: int, e: int) -> SimpleNamespace:
        g = torch.Generator().manual_seed(1000 * layer + e)
        return SimpleNamespace(
            w13=torch.randn(2 * self.i, self.h, generator=g) / self.h**0.5,
            w2=torch.randn(self.h, self.i, generator=g) / self.i**0.5,
        )

    def expert_into(self, layer: int, e: int, gate, up, w2) -> None:
        w = self.expert_weights(layer, e)
        gate.copy_(w.w13[: self.i].reshape(gate.shape))
        up.copy_(w.w13[self.i :].reshape(up.shape))
        w2.copy_(w.w2)


def make_worker(a: argparse.Namespace, wdtype: str) -> ExpertWorker:
    backend = CpuExpertBackend(threads=a.threads, weight_dtype=wdtype)
    slots = slot_table(RandomReader(a), backend, DT, CPU, a.experts)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    slots.preload(list(range(a.experts)))
    print(
        f"# {wdtype}: {a.layers} layers of {a.experts} experts ready in {time.perf_counter() - t0:.0f}s",
        flush=True,
    )
    return ExpertWorker(slots, backend, WorkerIdentity("cpu", "cpu", "bench"))


def inputs(a: argparse.Namespace, t: int, n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``n`` layers' requests of ``t`` rows: x [t, H] bf16, top-k distinct ids [t, K], weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(t, a.hidden, generator=g).to(DT)
        ids = torch.stack([torch.randperm(a.experts, generator=g)[: a.top_k] for _ in range(t)]).int()
        w = torch.softmax(torch.rand(t, a.top_k, generator=g), -1)
        out.append((x, ids, w))
    return out


def pct(v: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(v), q))


def bench_batch(a, worker, client: ShmClient, server: ShmServer, t: int, seq, steps) -> dict:
    """One batch size's columns (``seq``, ``steps``: the channel's counters)."""
    lnk = client.link
    assert lnk is not None, client.link_reason
    layers = worker.slots.moe_layers
    req_x, req_ids, req_w = lnk.req.x.view(torch.int16).numpy(), lnk.req.ids.numpy(), lnk.req.w.numpy()
    req_flag, ans_flag = lnk.req.flag.numpy(), lnk.ans.flag.numpy()
    rt, kern, launch = [], [], []
    sets = [inputs(a, t, len(layers), seed=s) for s in range(4)]
    flat = [[(x.view(torch.int16).numpy(), i.numpy(), w.numpy()) for x, i, w in s] for s in sets]
    for n in range(a.warmup + a.steps):
        step = next(steps)
        t0 = time.perf_counter()
        r = client.link_step(
            dsc.LinkStep(next(seq), step, t, t, worker.generation, 10_000), time.monotonic() + 10
        )
        assert r.code == 0, r.message
        launch.append(time.perf_counter() - t0)
        for i, (x, ids, w) in enumerate(flat[n % len(flat)]):
            req_x[:t], req_ids[:t], req_w[:t] = x, ids, w
            want = step * ll.STEP_SPAN + i + 1
            t1 = time.perf_counter()
            req_flag[0] = want
            while ans_flag[0] != want:
                pass
            rt.append(time.perf_counter() - t1)
        link = server._link
        report = link.collect()  # NOTE: the bench reads the step's C timings (its counts are dropped)
        assert report is not None and report.errors == 0, report
        kern.append(link.kernel_ns / 1e9 / len(layers))
    skip = a.warmup * len(layers)
    rt, kern, launch = rt[skip:], kern[a.warmup :], launch[a.warmup :]
    # the same layers from Python: forward_into, and today's fast path
    fi, shm = [], []
    be = worker.backend
    out = torch.empty(t, a.hidden, dtype=DT)
    for n in range(a.warmup + a.steps):
        for i, (x, ids, w) in enumerate(sets[n % len(sets)]):
            ls = worker.slots.live.layers[layers[i]]
            t1 = time.perf_counter()
            if not be.forward_into(x, ls.w13, ls.w2, ids, w, out):  # a call it leaves to forward
                be.forward(x, ls.w13, ls.w2, ids, w)
            fi.append(time.perf_counter() - t1)
            t1 = time.perf_counter()
            reply = client.send(ExpertRequest(next(seq), worker.generation, layers[i], x, ids, w), DT)
            assert reply is not None
            reply.result(10)
            shm.append(time.perf_counter() - t1)
            reply.release()
    fi, shm = fi[skip:], shm[skip:]
    us = 1e6
    k = statistics.median(kern)
    return {
        "rt50": pct(rt, 50) * us,
        "rt90": pct(rt, 90) * us,
        "kernel": k * us,
        "cost": (pct(rt, 50) - k) * us,
        "forward_into": pct(fi, 50) * us,
        "shm": pct(shm, 50) * us,
        "launch": pct(launch, 50) * us,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) - 4))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--weights", nargs="+", default=["int4", "bfloat16"])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    rows = max(a.batches)
    print(f"# {a.threads} kernel threads, {os.cpu_count()} cores; per MoE layer, microseconds", flush=True)
    print("| weights | T | round trip p50 | p90 | kernel | link cost | forward_into | shm path | launch |")
    print("|---|---|---|---|---|---|---|---|---|")
    seq, steps = itertools.count(1), itertools.count(1)
    for wdtype in a.weights:
        worker = make_worker(a, wdtype)
        client = ShmClient("shm", 1 << 24, CPU, spin_us=300, link=(rows, a.hidden, a.top_k, DT))
        server = ShmServer(
            Hello.decode(client.hello()),
            CPU,
            worker.forward,
            spin_us=300,
            forward_into=worker.forward_into,
            link=worker,
        )
        client.accept(server.start().result(30))
        try:
            for t in a.batches:
                r = bench_batch(a, worker, client, server, t, seq, steps)
                print(
                    f"| {wdtype} | {t} | {r['rt50']:.0f} | {r['rt90']:.0f} | {r['kernel']:.0f} | {r['cost']:.0f} "
                    f"| {r['forward_into']:.0f} | {r['shm']:.0f} | {r['launch']:.0f} |",
                    flush=True,
                )
        finally:
            server.close()
            server._thread.join(30)
            client.close()
        del worker


if __name__ == "__main__":
    main()
