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
Plus the server's host time per step (``LinkGraphs.launch``: on the coordinator's critical path,
it waits for the LinkStep's answer), the host time of one replay of the ``moe graph`` (its
cudaGraphLaunch alone) and the largest difference between the linked answers and the
baseline's (same kernels: 0 expected).

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


class Bench:
    """The shared state: weights, the link's areas and step graphs, the coordinator's words."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.dev = dev = torch.device("cuda", torch.cuda.current_device())
        self.a, self.dt = a, torch.bfloat16
        self.g = torch.Generator(device=dev).manual_seed(0)
        h, inter, e = a.hidden, a.inter, a.experts
        sets = [
            (
                (torch.randn(e, 2 * inter, h, generator=self.g, device=dev) * 0.02).to(self.dt),
                (torch.randn(e, h, inter, generator=self.g, device=dev) * 0.02).to(self.dt),
            )
            for _ in range(a.distinct)
        ]
        self.weights = [sets[i % a.distinct] for i in range(a.layers)]
        self.backend = TritonExpertBackend.for_device(dev)
        rows = max(a.batches)
        area = link.new_area(link.request_bytes(rows, h, a.top_k, self.dt), dev)
        self.graphs = LinkGraphs(self.backend, area, rows, h, a.top_k, self.dt, BUCKETS)
        self.req = link.RequestViews.of(area, rows, h, a.top_k, self.dt)
        self.ans = link.AnswerViews.of(self.graphs.answer, rows, h, self.dt)
        self.bw = copy_bandwidth(dev)
        self.c_step = link.StepWord(dev)
        self.c_abort = torch.full((1,), -1, dtype=torch.int64, device=dev)
        self.c_err = torch.zeros(1, dtype=torch.int64, device=dev)
        self.c_stream, self.s_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        self.step = 0

    def coordinator(self, tb: int, xs, ids, ws, outs) -> None:
        """The coordinator's per-layer link work (its linked graph without the model)."""
        req, ans, c = self.req, self.ans, self.c_step
        c.copy_in()
        for i in range(self.a.layers):
            req.x[:tb].copy_(xs[i])
            req.ids[:tb].copy_(ids[i])
            req.w[:tb].copy_(ws[i])
            link.signal(req.flag, c.step, i)
            link.wait(ans.flag, c.step, i, self.c_abort, self.c_err, 5.0)
            outs[i].copy_(ans.out[:tb])

    def moe(self, tb: int, xs, ids, ws, base) -> None:
        """The server's GPU work alone: the fused MoE of every layer."""
        a = self.a
        cfg = self.backend.table.lookup(a.hidden, a.inter, tb, a.top_k, a.experts)
        for i, (w13, w2) in enumerate(self.weights):
            fused_moe(xs[i], w13, w2, ids[i], ws[i], config=cfg, out=base[i])

    def batch(self, b: int) -> str:
        a, dev, g, n = self.a, self.dev, self.g, self.a.layers
        tb = next(x for x in self.graphs.buckets if x >= b)
        xs = torch.randn(n, tb, a.hidden, generator=g, device=dev).to(self.dt)
        ids = torch.randint(0, a.experts, (n, tb, a.top_k), generator=g, device=dev, dtype=torch.int32)
        ids[:, b:] = -1
        ws = torch.rand(n, tb, a.top_k, generator=g, device=dev)
        outs = torch.zeros(n, tb, a.hidden, dtype=self.dt, device=dev)
        base = torch.zeros_like(outs)
        # warm-up: every kernel loaded before anything spins (link.py's NOTE)
        self.c_abort.fill_(0)
        self.c_step.set(0, b)
        with torch.cuda.stream(self.c_stream):
            self.coordinator(tb, xs, ids, ws, outs)
            self.moe(tb, xs, ids, ws, base)
        torch.cuda.synchronize(dev)
        gc, gm = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(gc, stream=self.c_stream):
            self.coordinator(tb, xs, ids, ws, outs)
        with torch.cuda.graph(gm, stream=self.c_stream):
            self.moe(tb, xs, ids, ws, base)
        torch.cuda.synchronize(dev)
        self.c_abort.fill_(-1)
        self.c_err.zero_()  # the warm-up's aborted waits reported ERR_TIMEOUT
        t_moe, t_link, t_host, t_moe_host = [], [], [], []
        for _ in range(a.steps + 3):
            t0 = time.perf_counter()
            gm.replay()
            t_moe_host.append(time.perf_counter() - t0)
            torch.cuda.synchronize(dev)
            t_moe.append(time.perf_counter() - t0)
        for _ in range(a.steps + 3):
            self.step += 1
            t0 = time.perf_counter()
            with torch.cuda.stream(self.s_stream):
                self.graphs.launch(0, self.weights, tb, self.step, b, 5000)
            t1 = time.perf_counter()
            self.c_step.set(self.step, b)
            with torch.cuda.stream(self.c_stream):
                gc.replay()
                self.c_step.replayed()
            torch.cuda.synchronize(dev)
            t_link.append(time.perf_counter() - t0)
            t_host.append(t1 - t0)
        report = self.graphs.collect()
        assert int(self.c_err) == 0 and report is not None and report.errors == 0, (int(self.c_err), report)
        diff = float((outs[:, :b].float() - base[:, :b].float()).abs().max())
        m = statistics.median(t_moe[3:]) / n * 1e6
        k = statistics.median(t_link[3:]) / n * 1e6
        used = statistics.mean(
            int(torch.unique(ids[i, :b]).numel()) for i in range(n)
        )  # experts a layer reads
        floor = used * 3 * a.hidden * a.inter * 2 / self.bw * 1e6
        host = statistics.median(t_host[3:]) * 1e6
        moe_host = statistics.median(t_moe_host[3:]) * 1e6
        return f"| {b} | {m:.1f} | {k:.1f} | {k - m:.1f} | {floor:.1f} | {host:.0f} | {moe_host:.0f} | {diff:.3g} |"


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--distinct", type=int, default=4, help="distinct weight sets, cycled over the layers")
    a = p.parse_args()
    bench = Bench(a)
    print(
        f"# {torch.cuda.get_device_name(bench.dev)}, L={a.layers} H={a.hidden} I={a.inter} "
        f"E={a.experts} K={a.top_k} bf16, copy {bench.bw / 1e9:.0f} GB/s"
    )
    print(
        "| batch | moe graph us/layer | linked us/layer | link cost us/layer | HBM floor us/layer "
        "| server launch us/step | moe graph launch us | max diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for b in a.batches:
        print(bench.batch(b), flush=True)
    bench.graphs.close()


if __name__ == "__main__":
    main()
