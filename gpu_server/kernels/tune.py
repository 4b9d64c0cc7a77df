"""Re-tune the fused MoE launch configs on this GPU; writes configs/<gpu name>.json.

    python -m gpu_server.kernels.tune [--models qwen3-30b-a3b,...] [--tokens 1,8,...] [--jobs 12]

For every model shape and token count T (uniform random routing, bf16), each candidate block_m
gets its own alignment; the gate_up and down GEMMs are then timed separately over their candidate
tiles (median of triton.testing.do_bench, L2 flushed between calls) and the best of each kept;
the block_m with the lowest sum wins. Triton's own multi-config autotuner is not used: it does
not run under the CPU interpreter and would tune inside serving. Every candidate is compiled first,
in parallel worker processes that fill Triton's on-disk cache; candidates that fail to compile
(shared memory) are dropped. Shapes and token buckets not re-tuned keep their entries from the
existing file. The default set takes about a minute on an H200.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.testing import do_bench

from gpu_server.kernels.align import align_pairs
from gpu_server.kernels.config import CONFIG_DIR, ConfigTable, GemmConfig, MoeConfig, gpu_file_name, shape_key
from gpu_server.kernels.grouped_gemm import down, gate_up

MODELS = {  # name: (H, I, E, K)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)

# (block_n, block_k, group_m, num_warps, num_stages)
SMALL_M = [GemmConfig(bn, bk, 8, 4, st) for bn in (32, 64, 128) for bk in (128, 256) for st in (3, 4, 5)] + [
    GemmConfig(64, 64, 8, 4, 4),
    GemmConfig(128, 64, 8, 4, 4),
]
LARGE_M = [
    GemmConfig(*c)
    for c in [
        (64, 64, 8, 4, 4),
        (64, 128, 8, 4, 3),
        (128, 64, 8, 4, 4),
        (128, 128, 8, 4, 3),
        (128, 64, 8, 8, 3),
        (128, 64, 8, 8, 4),
        (128, 128, 8, 8, 3),
        (256, 64, 8, 8, 3),
        (256, 64, 8, 8, 4),
        (256, 128, 8, 8, 2),
        (128, 64, 4, 8, 4),
        (128, 64, 16, 8, 4),
        (128, 128, 8, 8, 2),
        (64, 64, 8, 8, 4),
        # small footprints: two programs per SM, so one's loads overlap the other's MMAs
        (128, 64, 8, 4, 2),
        (64, 64, 8, 4, 2),
        (64, 128, 8, 4, 2),
    ]
]


def block_m_candidates(t: int, k: int, e: int) -> list[int]:
    rows = t * k / e  # expected rows per slot under uniform routing
    cap = min(256, max(16, 2 * triton.next_power_of_2(math.ceil(rows))))
    return [
        bm
        for bm in (16, 32, 64, 128, 256)
        if bm <= cap and (rows < 64 or bm >= 64) and (rows >= 256 or bm < 256)
    ]


def gemm_candidates(block_m: int) -> list[GemmConfig]:
    return SMALL_M if block_m <= 32 else LARGE_M


def _compile(task):
    """Worker: run one (kernel, block_m, config) once on tiny inputs so Triton caches the binary."""
    which, bm, cfg, h, inter, k = task
    dev = "cuda"
    x = torch.randn(4, h, device=dev, dtype=torch.bfloat16)
    w13 = torch.randn(1, 2 * inter, h, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(1, h, inter, device=dev, dtype=torch.bfloat16)
    slot_ids = torch.zeros(4, k, dtype=torch.int32, device=dev)
    al = align_pairs(slot_ids, 1, bm)
    act = torch.empty(al.sorted_pairs.shape[0], inter, device=dev, dtype=torch.bfloat16)
    try:
        if which == "gate_up":
            gate_up(x, w13, al, k, cfg, act)
        else:
            y = torch.empty(4 * k, h, device=dev, dtype=torch.bfloat16)
            down(act, w2, torch.ones(4 * k, device=dev), al, cfg, y)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a config that cannot compile is reported, not fatal
        return task, f"{type(e).__name__}: {str(e)[:120]}"
    return task, None


def precompile(shapes, tokens, jobs: int) -> set:
    """Compile every candidate in parallel; returns the (kernel, block_m, config) that failed."""
    tasks = {}
    for h, inter, e, k in shapes:
        bms = {bm for t in tokens for bm in block_m_candidates(t, k, e)}
        for bm in sorted(bms):
            for cfg in gemm_candidates(bm):
                # one binary serves every shape with the same EVEN_K, so compile each once
                tasks[("gate_up", bm, cfg, h % cfg.block_k == 0)] = ("gate_up", bm, cfg, h, inter, k)
                tasks[("down", bm, cfg, inter % cfg.block_k == 0)] = ("down", bm, cfg, h, inter, k)
    t0 = time.time()
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        results = list(pool.map(_compile, tasks.values()))
    failed = {task[:3] for task, err in results if err}
    for task, err in results:
        if err:
            print(f"  dropped {task[:3]}: {err}", flush=True)
    print(f"compiled {len(tasks)} variants in {time.time() - t0:.0f} s, {len(failed)} failed", flush=True)
    return failed


def tune_one(h, inter, e, k, t, failed, rep_ms) -> tuple[MoeConfig, float]:
    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16, generator=gen) / h**0.5
    w2 = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16, generator=gen) / inter**0.5
    slot_ids = torch.topk(torch.randn(t, e, device="cuda", generator=gen), k, dim=-1).indices.int()
    topw = torch.rand(t * k, device="cuda", generator=gen)
    y = torch.empty(t * k, h, device="cuda", dtype=torch.bfloat16)
    best = None
    for bm in block_m_candidates(t, k, e):
        al = align_pairs(slot_ids, e, bm)
        act = torch.empty(al.sorted_pairs.shape[0], inter, device="cuda", dtype=torch.bfloat16)
        timed = {}
        for which in ("gate_up", "down"):
            runs = []
            for cfg in gemm_candidates(bm):
                if (which, bm, cfg) in failed:
                    continue
                if which == "gate_up":
                    fn = lambda c=cfg, al=al, act=act: gate_up(x, w13, al, k, c, act)  # noqa: E731
                else:
                    fn = lambda c=cfg, al=al, act=act: down(act, w2, topw, al, c, y)  # noqa: E731
                runs.append((do_bench(fn, warmup=5, rep=rep_ms, return_mode="median"), cfg))
            timed[which] = min(runs, key=lambda r: r[0])
        total = timed["gate_up"][0] + timed["down"][0]
        print(
            f"  T={t} block_m={bm}: gate_up {timed['gate_up'][0] * 1e3:.1f} us, down {timed['down'][0] * 1e3:.1f} us",
            flush=True,
        )
        if best is None or total < best[1]:
            best = (MoeConfig(bm, timed["gate_up"][1], timed["down"][1]), total)
    assert best is not None, f"no kernel configuration ran for T={t}"
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--jobs", type=int, default=12, help="parallel compile processes")
    p.add_argument("--rep-ms", type=float, default=25.0, help="do_bench time per candidate")
    a = p.parse_args()
    shapes = [MODELS[m] for m in a.models.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]
    name = torch.cuda.get_device_name()
    failed = precompile(shapes, tokens, a.jobs)
    path = CONFIG_DIR / gpu_file_name(name)
    table = ConfigTable.load(path) if path.exists() else ConfigTable(name, {})
    for h, inter, e, k in shapes:
        buckets = {}
        for t in tokens:
            cfg, ms = tune_one(h, inter, e, k, t, failed, a.rep_ms)
            buckets[t] = cfg
            print(f"H={h} I={inter} E={e} K={k} T={t}: {ms * 1e3:.1f} us (GEMMs) {cfg}", flush=True)
        table.shapes[shape_key(h, inter)] = {**table.shapes.get(shape_key(h, inter), {}), **buckets}
    table.save(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
