"""FP8 block-quantised fused MoE vs the bf16 fused MoE, side by side, at DeepSeek-V3 widths.

    python benchmarks/bench_fp8_moe.py [--tokens 1,8,...] [--md FILE]

Needs a GPU with FP8 (sm_89+). One run on one GPU: the HBM bandwidth and bf16 matmul peak
(bench_fused_moe.py's measurements), then for each T the median time, replayed from a CUDA
graph with L2 flushed (triton.testing.do_bench), of

  bf16   TritonExpertBackend on bf16 weights (the configs tuned for this GPU, else the default)
  w8a16  fused_moe_fp8: FP8 weights widened to bf16 in the kernel, bf16 tensor cores
  w8a8   fused_moe_fp8 act_fp8: activations quantised per token and K tile, FP8 tensor cores
  floor  max(bytes of the active experts' weights / bandwidth, flops / peak) for bf16 and FP8
         weights (FP8 flops at twice the bf16 peak, Hopper's ratio)

and each path's error against torch dequantise-then-matmul in float32 (the FP8 weights; bf16
rows use the same dequantised weights rounded to bf16). Routing: top-8 of random logits over
256 experts, every slot local.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_fused_moe import graph_time, measure_bandwidth, measure_peak, routing  # noqa: E402
from expertmesh import quant  # noqa: E402
from gpu_server.backend import make_backend  # noqa: E402
from gpu_server.kernels.config import GemmConfig, MoeConfig  # noqa: E402
from gpu_server.kernels.fp8_moe import fused_moe_fp8  # noqa: E402

SHAPE = (7168, 2048, 256, 8)  # DeepSeek-V3 / R1 / Kimi-K2 routed experts: H, I, E, K
BLOCK = (128, 128)


def quantised_experts(h: int, inter: int, e: int, gen: torch.Generator):
    """FP8 experts (+ scales) and their bf16 dequantisation, made one expert at a time."""
    q13 = torch.empty(e, 2 * inter, h, dtype=quant.FP8_DTYPE, device="cuda")
    q2 = torch.empty(e, h, inter, dtype=quant.FP8_DTYPE, device="cuda")
    s13 = torch.empty(e, 2 * inter // BLOCK[0], -(-h // BLOCK[1]), device="cuda")
    s2 = torch.empty(e, -(-h // BLOCK[0]), -(-inter // BLOCK[1]), device="cuda")
    b13 = torch.empty(e, 2 * inter, h, dtype=torch.bfloat16, device="cuda")
    b2 = torch.empty(e, h, inter, dtype=torch.bfloat16, device="cuda")
    for i in range(e):
        q13[i], s13[i] = quant.quantize(
            torch.randn(2 * inter, h, device="cuda", generator=gen) / h**0.5, BLOCK
        )
        q2[i], s2[i] = quant.quantize(torch.randn(h, inter, device="cuda", generator=gen) / inter**0.5, BLOCK)
        b13[i] = quant.dequantize(q13[i], s13[i], BLOCK).to(torch.bfloat16)
        b2[i] = quant.dequantize(q2[i], s2[i], BLOCK).to(torch.bfloat16)
    return q13, s13, q2, s2, b13, b2


def reference(x, q13, s13, q2, s2, ids, w) -> torch.Tensor:
    out = torch.zeros(x.shape[0], q2.shape[1], device="cuda")
    inter = q2.shape[2]
    for e in torch.unique(ids).tolist():
        tok, kk = (ids == e).nonzero(as_tuple=True)
        gu = x[tok].float() @ quant.dequantize(q13[e], s13[e], BLOCK).T
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (act @ quant.dequantize(q2[e], s2[e], BLOCK).T) * w[tok, kk, None])
    return out


SWEEP = [  # (block_m, block_n, block_k, group_m, num_warps, num_stages) for both GEMMs
    (16, 64, 128, 1, 4, 4),
    (32, 128, 128, 8, 4, 4),
    (64, 64, 128, 8, 4, 4),
    (64, 128, 128, 8, 4, 3),
    (64, 128, 128, 8, 8, 3),
    (128, 128, 64, 8, 8, 3),
    (128, 128, 128, 8, 8, 2),
]


def sweep(t, x, ids, w, experts, rows_out) -> None:
    """Times each SWEEP config for both FP8 modes at one T (a hand-run tuning aid)."""
    q13, s13, q2, s2 = experts
    for bm, bn, bk, gm, nw, ns in SWEEP:
        g = GemmConfig(bn, bk, gm, nw, ns)
        cfg = MoeConfig(bm, g, g)
        for act in (False, True):
            ms = graph_time(
                lambda c=cfg, a=act: fused_moe_fp8(x, q13, s13, q2, s2, ids, w, BLOCK, c, a), rep=100
            )
            rows_out.append((t, (bm, bn, bk, gm, nw, ns), act, ms))
            print(f"sweep T={t} {cfg.block_m} {g} act_fp8={act}: {ms * 1e3:.1f} us", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,32,128,512,2048")
    p.add_argument("--md", type=Path, help="also write the markdown table here")
    p.add_argument("--sweep", default="", help="token counts at which to also time SWEEP configs")
    a = p.parse_args()
    device = torch.cuda.get_device_name()
    bw, peak = measure_bandwidth(), measure_peak()
    print(f"{device}: bandwidth {bw / 1e12:.2f} TB/s, bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    h, inter, e, k = SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    q13, s13, q2, s2, b13, b2 = quantised_experts(h, inter, e, gen)
    backend = make_backend("cuda")
    rows = []
    for t in (int(v) for v in a.tokens.split(",")):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids, w = routing(t, e, k, gen)
        ref = reference(x, q13, s13, q2, s2, ids, w)
        fp8_args = (x, q13, s13, q2, s2, ids, w, BLOCK)
        fns = {
            "bf16": lambda a=(x, b13, b2, ids, w): backend.forward(*a),
            "w8a16": lambda a=fp8_args: fused_moe_fp8(*a),
            "w8a8": lambda a=fp8_args: fused_moe_fp8(*a, act_fp8=True),
        }
        times, errs = {}, {}
        for name, fn in fns.items():
            errs[name] = ((fn().float() - ref).norm() / ref.norm()).item()
            times[name] = graph_time(fn, rep=200)
        active = torch.unique(ids).numel()
        flops = 2 * ids.numel() * 3 * h * inter
        floor16 = max(active * 3 * h * inter * 2 / bw, flops / peak) * 1e3
        floor8 = max(active * 3 * h * inter * 1 / bw, flops / (2 * peak)) * 1e3
        rows.append((t, times, errs, floor16, floor8))
        if str(t) in a.sweep.split(","):
            sweep(t, x, ids, w, (q13, s13, q2, s2), [])
        print(
            f"T={t:5d} "
            + "  ".join(f"{n} {times[n] * 1e3:8.1f} us (err {errs[n]:.1e})" for n in fns)
            + f"  floor bf16 {floor16 * 1e3:.1f} fp8 {floor8 * 1e3:.1f} us",
            flush=True,
        )
    md = [
        f"{device}: measured HBM bandwidth {bw / 1e12:.2f} TB/s (copy, read+write), bf16 peak "
        f"{peak / 1e12:.0f} TFLOP/s. DeepSeek-V3 experts: H {h}, I {inter}, {e} experts, top-{k}, "
        f"{BLOCK[0]}x{BLOCK[1]} blocks.",
        "",
        "| T | bf16 us | w8a16 us | w8a8 us | bf16/w8a16 | bf16/w8a8 | floor bf16 us | floor fp8 us "
        "| err bf16 / w8a16 / w8a8 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for t, tm, er, f16, f8 in rows:
        md.append(
            f"| {t} | {tm['bf16'] * 1e3:.1f} | {tm['w8a16'] * 1e3:.1f} | {tm['w8a8'] * 1e3:.1f} | "
            f"{tm['bf16'] / tm['w8a16']:.2f} | {tm['bf16'] / tm['w8a8']:.2f} | {f16 * 1e3:.1f} | "
            f"{f8 * 1e3:.1f} | {er['bf16']:.1e} / {er['w8a16']:.1e} / {er['w8a8']:.1e} |"
        )
    text = "\n".join(md)
    print(text)
    if a.md:
        a.md.write_text(text + "\n")


if __name__ == "__main__":
    main()
