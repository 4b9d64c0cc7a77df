"""Fused MoE kernel vs a per-expert torch loop, torch._grouped_mm, and the physical floor.

    python benchmarks/bench_fused_moe.py [--models qwen3-30b-a3b,...] [--tokens 1,8,...] [--md FILE]

Needs a CUDA GPU. Everything is measured in one run on one GPU: the HBM bandwidth (a large
device-to-device copy, bytes read plus written), the bf16 matrix peak (8192^3 on random data),
then for each model shape and token count T the median time of

  fused       TritonExpertBackend (tuned configs of this GPU), replayed from a CUDA graph
  grouped_mm  sort by expert + torch._grouped_mm x2 + weighted index_add, from a CUDA graph
  loop        expertmesh.experts.torch_moe (a loop over experts; syncs, so run eagerly)
  floor       max(bytes of the active experts' weights / bandwidth, flops / peak)
  stages      the fused path's four stages, each timed alone (eager, so launch gaps included)

triton.testing.do_bench flushes L2 before every timed call, so weights come from HBM.
Routing is uniform: top-k of random logits, softmax weights, every slot local (no -1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expertmesh.experts import torch_moe  # noqa: E402
from gpu_server.backend import make_backend  # noqa: E402
from gpu_server.kernels.align import align_pairs  # noqa: E402
from gpu_server.kernels.grouped_gemm import down, gate_up  # noqa: E402
from gpu_server.kernels.reduce import sum_k  # noqa: E402
from gpu_server.kernels.tune import MODELS, TOKENS  # noqa: E402


def grouped_mm_moe(x, w13, w2, slot_ids, weights):
    """The baseline: experts as two torch._grouped_mm calls over expert-sorted rows."""
    t, k = slot_ids.shape
    s, inter = w13.shape[0], w2.shape[2]
    flat = slot_ids.reshape(-1)  # [P]
    key = torch.where(flat < 0, s, flat).long()  # skipped pairs sort last, past every group
    order = torch.argsort(key)  # [P]
    counts = torch.zeros(s + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:s], 0, dtype=torch.int32)  # [S] group ends
    tok = order // k  # [P]
    gu = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)  # [P, 2I]
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [P, H]
    w = weights.reshape(-1)[order]
    y = torch.where((key[order] < s)[:, None], y.float() * w[:, None], 0.0)  # rows past offs are unset
    return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))


def measure_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read and written."""
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def measure_peak() -> float:
    """bf16 FLOP/s of an 8192^3 matrix product on random data."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def graph_time(fn, rep: int) -> float:
    """Median ms of replaying a CUDA graph of ``fn`` (kernels compiled before capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=20, rep=rep, return_mode="median")


def stage_times(backend, x, w13, w2, slot_ids, weights) -> tuple[float, ...]:
    """Median ms of each stage of the fused path, timed alone (eager launches)."""
    t, k = slot_ids.shape
    e, inter = w13.shape[0], w2.shape[2]
    cfg = backend.table.lookup(x.shape[1], inter, t, k, e).fitted(x.element_size())
    al = align_pairs(slot_ids, e, cfg.block_m)
    act = torch.empty(al.sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    y = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    topw = weights.reshape(-1)
    fns = [
        lambda: align_pairs(slot_ids, e, cfg.block_m),
        lambda: gate_up(x, w13, al, k, cfg.gate_up, act),
        lambda: down(act, w2, topw, al, cfg.down, y),
        lambda: sum_k(y, slot_ids, out),
    ]
    return tuple(do_bench(f, warmup=10, rep=50, return_mode="median") for f in fns)


def routing(t: int, e: int, k: int, gen: torch.Generator):
    logits = torch.randn(t, e, generator=gen, device="cuda")
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def bench_model(name, tokens, bw, peak, backend, loop_max_ms, rows):
    h, inter, e, k = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16, generator=gen) / h**0.5
    w2 = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16, generator=gen) / inter**0.5
    for t in tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        slot_ids, weights = routing(t, e, k, gen)
        args = (x, w13, w2, slot_ids, weights)
        fused = backend.forward(*args)
        ref = grouped_mm_moe(*args)
        err = ((fused.float() - ref.float()).norm() / ref.float().norm()).item()
        t_fused = graph_time(lambda a=args: backend.forward(*a), rep=200)
        t_gmm = graph_time(lambda a=args: grouped_mm_moe(*a), rep=200)
        t_loop = do_bench(lambda a=args: torch_moe(*a), warmup=10, rep=loop_max_ms, return_mode="median")
        active = torch.unique(slot_ids).numel()
        nbytes = active * 3 * h * inter * 2
        flops = 2 * slot_ids.numel() * 3 * h * inter
        floor = max(nbytes / bw, flops / peak) * 1e3
        stages = stage_times(backend, *args)
        rows.append((name, t, t_fused, t_gmm, t_loop, floor, err, stages))
        print(
            f"{name:17s} T={t:5d}  fused {t_fused * 1e3:9.1f} us  gmm {t_gmm * 1e3:9.1f} us  "
            f"loop {t_loop * 1e3:10.1f} us  floor {floor * 1e3:8.1f} us  err {err:.1e}  stages "
            + "/".join(f"{v * 1e3:.1f}" for v in stages),
            flush=True,
        )


def table(rows, bw, peak, device) -> str:
    out = [
        f"{device}: measured HBM bandwidth {bw / 1e12:.2f} TB/s (copy, read+write), "
        f"bf16 peak {peak / 1e12:.0f} TFLOP/s (8192^3 matmul, random data).",
        "",
        "| model | T | fused us | grouped_mm us | loop us | floor us | fused/floor | gmm/fused | loop/fused "
        "| align / gate_up / down / reduce us |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, t, tf, tg, tl, fl, _, st in rows:
        out.append(
            f"| {name} | {t} | {tf * 1e3:.1f} | {tg * 1e3:.1f} | {tl * 1e3:.1f} | {fl * 1e3:.1f} | "
            f"{tf / fl:.2f} | {tg / tf:.2f} | {tl / tf:.1f} | "
            + " / ".join(f"{v * 1e3:.1f}" for v in st)
            + " |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--loop-ms", type=float, default=300.0, help="time budget per loop measurement")
    p.add_argument("--md", type=Path, help="also write the markdown table here")
    a = p.parse_args()
    device = torch.cuda.get_device_name()
    bw, peak = measure_bandwidth(), measure_peak()
    print(f"{device}: bandwidth {bw / 1e12:.2f} TB/s, bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    backend = make_backend("cuda")
    rows: list = []
    tokens = [int(t) for t in a.tokens.split(",")]
    for name in a.models.split(","):
        bench_model(name, tokens, bw, peak, backend, a.loop_ms, rows)
        torch.cuda.empty_cache()
    md = table(rows, bw, peak, device)
    print(md)
    if a.md:
        a.md.write_text(md + "\n")


if __name__ == "__main__":
    main()
