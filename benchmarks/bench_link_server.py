"""The expert server's step graph of the device link (gpu_server/link_graphs.py) at real widths,
in ONE process on one GPU: a stand-in coordinator graph on a second stream hands over every
MoE layer of a step through link.signal / link.wait (copies in, flag, wait, copy out), the
server's step graph waits, takes the routing, runs the fused MoE and answers.

Columns (per MoE layer, microseconds, median over the timed steps):
- ``moe graph``: the same fused MoE kernels, all layers in one CUDA graph, no link (the
  server's GPU work: the baseline);
- ``linked``: a whole linked step (server launch from the host + coordinator replay, until
  both finished) divided by the layers;
- ``link cost``: linked - moe graph (hand-over, routing take, copies);
- ``HBM floor``: the experts' weight bytes a layer must read over the measured copy bandwidth.
Plus the server's host time per step (``LinkGraphs.launch``) and the largest difference between
the linked answers and the baseline's (same kernels: 0 expected).

Two processes on two GPUs add the NVLink reads of the flags and payloads; this isolates the
server's side. ``python3 benchmarks/bench_link_server.py [--layers 48] [--batches 1 16 64]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from expertmesh.transport import link
from gpu_server.backend import TritonExpertBackend
from gpu_server.graphs import BUCKETS
from gpu_server.kernels import fused_moe
from gpu_server.link_graphs import LinkGraphs


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize(dev)
    return 2 * a.numel() * 10 / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--distinct", type=int, default=4, help="distinct weight sets, cycled over the layers")
    a = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    dt, L, H, I, E, K = torch.bfloat16, a.layers, a.hidden, a.inter, a.experts, a.top_k
    g = torch.Generator(device=dev).manual_seed(0)
    sets = [
        (
            (torch.randn(E, 2 * I, H, generator=g, device=dev) * 0.02).to(dt),
            (torch.randn(E, H, I, generator=g, device=dev) * 0.02).to(dt),
        )
        for _ in range(a.distinct)
    ]
    weights = [sets[i % a.distinct] for i in range(L)]
    backend = TritonExpertBackend.for_device(dev)
    rows = max(a.batches)
    area = link.new_area(link.request_bytes(rows, H, K, dt), dev)
    graphs = LinkGraphs(backend, area, rows, H, K, dt, BUCKETS)
    req = link.RequestViews.of(area, rows, H, K, dt)
    ans = link.AnswerViews.of(graphs.answer, rows, H, dt)
    bw = copy_bandwidth(dev)
    c_step = link.StepWord(dev)
    c_abort = torch.full((1,), -1, dtype=torch.int64, device=dev)
    c_err = torch.zeros(1, dtype=torch.int64, device=dev)
    c_stream, s_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    step = 0
    print(
        f"# {torch.cuda.get_device_name(dev)}, L={L} H={H} I={I} E={E} K={K} bf16, copy {bw / 1e9:.0f} GB/s"
    )
    print(
        "| batch | moe graph us/layer | linked us/layer | link cost us/layer | HBM floor us/layer | server host us/step | max diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for b in a.batches:
        tb = next(x for x in graphs.buckets if x >= b)
        xs = torch.randn(L, tb, H, generator=g, device=dev).to(dt)
        ids = torch.randint(0, E, (L, tb, K), generator=g, device=dev, dtype=torch.int32)
        ids[:, b:] = -1
        ws = torch.rand(L, tb, K, generator=g, device=dev)
        outs = torch.zeros(L, tb, H, dtype=dt, device=dev)
        base = torch.zeros_like(outs)

        def coordinator() -> None:
            c_step.copy_in()
            for i in range(L):
                req.x[:tb].copy_(xs[i])
                req.ids[:tb].copy_(ids[i])
                req.w[:tb].copy_(ws[i])
                link.signal(req.flag, c_step.step, i)
                link.wait(ans.flag, c_step.step, i, c_abort, c_err, 5.0)
                outs[i].copy_(ans.out[:tb])

        def moe() -> None:
            for i, (w13, w2) in enumerate(weights):
                cfg = backend.table.lookup(H, I, tb, K, E)
                fused_moe(xs[i], w13, w2, ids[i], ws[i], config=cfg, out=base[i])

        # warm-up: every kernel loaded before anything spins (link.py's NOTE)
        c_abort.fill_(0)
        c_step.set(0, b)
        with torch.cuda.stream(c_stream):
            coordinator()
            moe()
        torch.cuda.synchronize(dev)
        gc, gm = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(gc, stream=c_stream):
            coordinator()
        with torch.cuda.graph(gm, stream=c_stream):
            moe()
        torch.cuda.synchronize(dev)
        c_abort.fill_(-1)
        t_moe, t_link, t_host = [], [], []
        for _ in range(a.steps + 3):
            t0 = time.perf_counter()
            gm.replay()
            torch.cuda.synchronize(dev)
            t_moe.append(time.perf_counter() - t0)
        for _ in range(a.steps + 3):
            step += 1
            t0 = time.perf_counter()
            with torch.cuda.stream(s_stream):
                graphs.launch(0, weights, tb, step, b, 5000)
            t1 = time.perf_counter()
            c_step.set(step, b)
            with torch.cuda.stream(c_stream):
                gc.replay()
                c_step.replayed()
            torch.cuda.synchronize(dev)
            t_link.append(time.perf_counter() - t0)
            t_host.append(t1 - t0)
        report = graphs.collect()
        assert int(c_err) == 0 and report is not None and report.errors == 0, (int(c_err), report)
        diff = float((outs[:, :b].float() - base[:, :b].float()).abs().max())
        m = statistics.median(t_moe[3:]) / L * 1e6
        k = statistics.median(t_link[3:]) / L * 1e6
        used = statistics.mean(
            int(torch.unique(ids[i, :b]).numel()) for i in range(L)
        )  # experts a layer reads
        floor = used * 3 * H * I * 2 / bw * 1e6
        host = statistics.median(t_host[3:]) * 1e6
        print(f"| {b} | {m:.1f} | {k:.1f} | {k - m:.1f} | {floor:.1f} | {host:.0f} | {diff:.3g} |")
    graphs.close()


if __name__ == "__main__":
    main()
