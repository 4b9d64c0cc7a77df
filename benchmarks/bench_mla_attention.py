"""MLA decode attention at DeepSeek-V2-Lite widths: the absorbed kernel over the latent cache
(coordinator/model/kernels/mla_attention.py, a few tile configs, with and without split-KV) against the paged kernel over the
decompressed per-head K/V that the cache held before (16 heads, K 192, V 128), same run, with
the bytes each must read from the cache over the measured copy bandwidth.

    python benchmarks/bench_mla_attention.py          # on a CUDA machine

Shapes: B decode rows (one per sequence), S context, Hq heads, Rkv latent, Dr rotary dim.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.model.batch import ForwardBatch  # noqa: E402
from coordinator.model.kernels.mla_attention import mla_attention_triton  # noqa: E402
from coordinator.model.kernels.paged_attention import paged_attention_triton  # noqa: E402

HQ, RKV, DR, DN, DV, PAGE = 16, 512, 64, 128, 128, 16


def step(b: int, s: int, dev: torch.device) -> ForwardBatch:
    pages = -(-(s + 1) // PAGE)
    perm = torch.randperm(b * pages).tolist()
    seqs = [([1], s, perm[i * pages : (i + 1) * pages]) for i in range(b)]
    return ForwardBatch.build(seqs, PAGE, dev)


def median_us(fn, *args, **kw) -> float:
    """Median of CUDA-graph replays: kernel time without Python's launch cost (the decode step
    runs as a graph), which plain launches of these few-microsecond kernels would measure instead."""
    f = functools.partial(fn, *args, **kw)
    f()  # compile outside the capture
    return 1e3 * triton.testing.do_bench_cudagraph(f, rep=50, return_mode="median")


def main() -> None:
    dev = torch.device("cuda")
    bf = torch.bfloat16
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    bw = (
        2
        * a.numel()
        / (1e-3 * triton.testing.do_bench(functools.partial(torch.clone, a), return_mode="median"))
    )
    del a
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| batch | context | kernel | us | cache bytes read | floor us |")
    print("|---|---|---|---|---|---|")
    for b in (1, 16, 64):
        for s in (96, 1024):
            batch = step(b, s, dev)
            rows = int(batch.page_table.max()) * PAGE + PAGE
            q_lat = torch.randn(HQ, b, RKV, device=dev, dtype=bf)
            q_rope = torch.randn(b, HQ, DR, device=dev, dtype=bf)
            cache = torch.randn(rows, RKV + DR, device=dev, dtype=bf)
            args = (batch.page_table, batch.token_seq, batch.positions, PAGE, 0.07)
            lat_bytes = b * (s + 1) * (RKV + DR) * 2
            # splits None: the default (enough programs for every SM), 1: one program per token
            for bn, nw, sp in ((64, 8, 1), (32, 4, 1), (64, 8, None), (32, 4, None)):
                us = median_us(
                    mla_attention_triton, q_lat, q_rope, cache, *args, block_n=bn, num_warps=nw, splits=sp
                )
                tile = f"BLOCK_N {bn}, {nw} warps, splits {sp or 'default'}"
                print(f"| {b} | {s} | latent, {tile} | {us:.1f} | {lat_bytes} | "
                      f"{lat_bytes / bw * 1e6:.2f} |")  # fmt: skip
            q = torch.randn(b, HQ, DN + DR, device=dev, dtype=bf)
            k = torch.randn(rows, HQ, DN + DR, device=dev, dtype=bf)
            v = torch.randn(rows, HQ, DV, device=dev, dtype=bf)
            us = median_us(paged_attention_triton, q, k, v, *args)
            old_bytes = b * (s + 1) * HQ * (DN + DR + DV) * 2
            print(
                f"| {b} | {s} | decompressed K/V (before) | {us:.1f} | {old_bytes} | {old_bytes / bw * 1e6:.2f} |"
            )


if __name__ == "__main__":
    main()
