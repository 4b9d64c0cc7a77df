"""MoE layer time with multi-adapter LoRA vs without, at real widths (random weights).

GPU: ``fused_moe`` (base) vs ``fused_moe_lora`` (every token carries one of N adapters, N mixed
in the batch) vs the per-(slot, adapter) torch loop (``moe_lora_reference``), bf16. Both fused
paths use this GPU's tuned launch config for the shape and are replayed from CUDA graphs;
triton's do_bench flushes L2 before every call, so weights come from HBM.
CPU: ``torch_moe`` (base) vs ``moe_lora_reference`` (the CPU server's batched path), bf16.
The floor is the bytes of the touched expert weights (+ their LoRA) over memory bandwidth.

    python benchmarks/bench_moe_lora.py --device cuda --bandwidth 3.35e12
    python benchmarks/bench_moe_lora.py --device cpu --tokens 1 16 64
"""

from __future__ import annotations

import argparse
import time

import torch

from expertmesh.lora import ExpertLoRA, MoELoRAWeights, moe_lora_reference

MODELS = {"qwen3_30b_a3b": (2048, 768, 128, 8), "deepseek_v2_lite": (2048, 1408, 64, 6)}


def inputs(t, h, inter, s, k, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=device).to(dtype)
    w13 = (torch.randn(s, 2 * inter, h, generator=g, device=device) / h**0.5).to(dtype)
    w2 = (torch.randn(s, h, inter, generator=g, device=device) / inter**0.5).to(dtype)
    slot_ids = torch.rand(t, s, generator=g, device=device).topk(k, dim=1).indices
    weights = torch.rand(t, k, generator=g, device=device)
    return x, w13, w2, slot_ids, weights


def lora_weights(n, s, h, inter, rank, dtype, device):
    g = torch.Generator(device=device).manual_seed(1)
    ads = [
        ExpertLoRA(
            torch.randn(s, 2 * rank, h, generator=g, device=device) / h**0.5,  # separate gate/up A: 2r
            torch.randn(s, 2 * inter, 2 * rank, generator=g, device=device) / rank,
            torch.randn(s, rank, inter, generator=g, device=device) / inter**0.5,
            torch.randn(s, h, rank, generator=g, device=device) / rank,
        )
        for _ in range(n)
    ]
    w = MoELoRAWeights.stack(ads)
    return MoELoRAWeights(*(t.to(dtype) for t in (w.a13, w.b13, w.a2, w.b2)))


def graph_us(fn) -> float:
    """Median us of replaying a CUDA graph of ``fn`` (kernels compiled before capture)."""
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=20, rep=200, return_mode="median") * 1e3


def timeit(fn, device, iters):
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[len(times) // 2]  # median, us


def floor_us(slot_ids, h, inter, rank, bandwidth, itemsize=2):
    touched = torch.unique(slot_ids).numel()
    base = touched * 3 * h * inter * itemsize
    lora = touched * (2 * rank * (h + 2 * inter) + rank * (inter + h)) * itemsize
    return base / bandwidth * 1e6, (base + lora) / bandwidth * 1e6


def row(dev, table, shape, rank: int, n_ad: int, t: int, args) -> str:
    """One table row: base vs LoRA (vs the torch loop) for T tokens, N adapters mixed."""
    from expertmesh.experts import torch_moe

    h, inter, s, k = shape
    dtype = torch.bfloat16
    lw = lora_weights(n_ad, s, h, inter, rank, dtype, dev)
    x, w13, w2, slot_ids, weights = inputs(t, h, inter, s, k, dtype, dev)
    ta = torch.arange(t, device=dev) % n_ad  # every token has an adapter, all mixed
    if dev == "cuda":
        from gpu_server.kernels import fused_moe
        from gpu_server.kernels.moe_lora import fused_moe_lora

        cfg = table.lookup(h, inter, t, k, s)
        base = graph_us(lambda: fused_moe(x, w13, w2, slot_ids, weights, config=cfg))
        lora = graph_us(lambda: fused_moe_lora(x, w13, w2, slot_ids, weights, lw, ta, config=cfg))
    else:
        base = timeit(lambda: torch_moe(x, w13, w2, slot_ids, weights), dev, args.iters)
        lora = timeit(lambda: moe_lora_reference(x, w13, w2, slot_ids, weights, lw, ta), dev, args.iters)
    loop = float("nan")
    if dev == "cuda" and t <= args.loop_max_tokens:
        loop = timeit(lambda: moe_lora_reference(x, w13, w2, slot_ids, weights, lw, ta), dev, 5)
    fb, fl = floor_us(slot_ids, h, inter, rank, args.bandwidth)
    return (
        f"| {t} | {rank} | {n_ad} | {base:.1f} | {lora:.1f} | {lora / base:.2f}x | {loop:.1f} | "
        f"{loop / lora:.1f}x | {fb:.1f} | {fl:.1f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16])
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4], help="adapters mixed in the batch")
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="memory bytes/s for the floor")
    ap.add_argument("--iters", type=int, default=20, help="CPU timing iterations")
    ap.add_argument("--loop-max-tokens", type=int, default=64, help="skip the slow torch loop above this T")
    args = ap.parse_args()
    dev = args.device
    table = None
    if dev == "cuda":
        from gpu_server.backend import TritonExpertBackend

        table = TritonExpertBackend.for_device(dev).table
    where = torch.cuda.get_device_name() if dev == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"{where}; bf16; every token carries an adapter; times in us (median)")
    for model, shape in MODELS.items():
        print(f"\n{model} (H, I, E, top-k) = {shape}\n")
        print(
            "| T | rank | adapters | base | LoRA | LoRA/base | torch loop | loop/LoRA | floor base | floor LoRA |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for rank in args.ranks:
            for n_ad in args.adapters:
                for t in args.tokens:
                    print(row(dev, table, shape, rank, n_ad, t, args), flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
