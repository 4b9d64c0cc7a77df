"""The AMX prefill kernel against builds of itself (a baseline copy of the kernels, compile-time
variants) and the same run's peaks, one MoE layer at real widths.

Every variant runs the same packed weights and routes, rounds interleaved (A B C A B C ...) so
that the VM's drift hits all alike; each row gives the median and the spread of the rounds'
medians. A profile build (AMX_PROFILE) of each build of this tree splits its time into stages
(and the threads' work per phase, mean and slowest). Builds compile in parallel. Floors: the active
experts' bytes over the measured read bandwidth, the FLOPs over the measured peaks.

    python benchmarks/bench_cpu_prefill.py --threads 16 --baseline /path/to/old/kernels/moe_gemv.c \\
        --variant bal3:AMX_BAL=3 --variant loads:AMX_DIAG=1 --out prefill.json

Decode sizes as a hybrid server sees them: ``--held 64`` (the server holds half of Qwen3's 128
experts, the rest route as -1) and ``--layers 8`` (each call on the next of 8 copies of the
weights, as a model's layers come, instead of ``--flush``):

    python benchmarks/bench_cpu_prefill.py --threads 28 --models qwen3-30b-a3b --tokens 1,8 \\
        --dtypes bfloat16 --call server --layers 8 --held 64 --variant old:AMX_LEAN=0
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks import bench_cpu_experts
from benchmarks.bench_cpu_experts import MODELS, dram_bandwidth, gemm_peak, host_info, l3_bytes, timeit
from cpu_expert_server import kernels
from cpu_expert_server.backend import CpuExpertBackend
from cpu_expert_server.packing import PER_ROW
from expertmesh.experts import TorchExpertBackend

STAGES = (
    *("gather", "phase1", "quant2", "phase2", "setup", "call"),
    *("p1_busy_mean", "p1_busy_max", "p2_busy_mean", "p2_busy_max"),
    *("gather_quant", "thread_start_spread"),
)


def variant_defines(baseline: str | None, variants: list[str]) -> dict[str, tuple[tuple[str, ...], Path]]:
    """name -> (macros, source): "new" (this tree), "old" (--baseline), and NAME[@SOURCE][:DEF[;DEF]]
    builds (SOURCE: the moe_gemv.c of another copy, this tree's by default)."""
    builds: dict[str, tuple[tuple[str, ...], Path]] = {"new": ((), kernels.SOURCE)}
    if baseline:
        builds["old"] = ((), Path(baseline))
    for v in variants:
        spec, _, defs = v.partition(":")
        name, _, source = spec.partition("@")
        builds[name] = (tuple(d for d in defs.split(";") if d), Path(source) if source else kernels.SOURCE)
    return builds


def variant_libs(builds: dict[str, tuple[tuple[str, ...], Path]], profile: bool) -> dict[str, ctypes.CDLL]:
    """The builds compiled in parallel (a few seconds each, one core each), then loaded; with
    ``profile`` also an AMX_PROFILE build of each of this tree's, named NAME+prof."""
    jobs = dict(builds)
    if profile:
        jobs |= {n + "+prof": ((*d, "AMX_PROFILE"), s) for n, (d, s) in builds.items() if s == kernels.SOURCE}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda ds: kernels.build(*ds), jobs.values()))
    libs = {n: kernels.load(d, s) for n, (d, s) in jobs.items()}
    missing = [n for n, lib in libs.items() if lib is None]
    assert not missing, f"builds failed: {missing} (see the log)"
    return {n: lib for n, lib in libs.items() if lib is not None}


def padded(p: torch.Tensor) -> torch.Tensor:
    """The same packed rows [S, R, C] with a row stride 64 bytes longer (a view): rows 4 KiB apart
    (bf16 at H = 2048) put a tile's 16 rows in one L1 set; one more cache line spreads them."""
    extra = 64 // p.element_size()
    buf = torch.zeros(p.shape[0], p.shape[1], p.shape[2] + extra, dtype=p.dtype)
    buf[:, :, : p.shape[2]] = p
    return buf[:, :, : p.shape[2]]


CALL = "forward"  # --call


def runner(
    b: CpuExpertBackend, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routes: list
) -> Callable:
    """The r-th of the 16 routes, for timeit: --call forward (fp32 in and out around the kernel,
    converted by torch), or --call server (the CPU server's own call, forward_into: bf16 hidden
    states and answer, int32 ids as the wire brings them, conversions in the kernel)"""
    layers = list(zip(w13, w2, strict=True))  # copies of the weights (--layers): call r on r % n
    n = len(layers)
    if CALL == "forward":
        return lambda r: b.forward(x, *layers[r % n], *routes[r % 16])
    wire = [(ids.to(torch.int32), w.float()) for ids, w in routes]
    out = torch.empty_like(x)

    def serve(r: int) -> torch.Tensor:
        assert b.forward_into(x, *layers[r % n], *wire[r % 16], out), "forward_into declined the call"
        return out

    return serve


def bench(args: argparse.Namespace, info: dict, libs: dict[str, ctypes.CDLL]) -> list[dict]:
    timed = {n: lib for n, lib in libs.items() if not n.endswith("+prof")}
    rows = []
    for name in args.models.split(","):
        h, i, e, k = MODELS[name]
        held = min(args.held or e, e)
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(held, 2 * i, h, generator=g) / h**0.5).bfloat16()  # [held, 2I, H]
        w2 = (torch.randn(held, h, i, generator=g) / i**0.5).bfloat16()  # [held, H, I]
        for wd in args.dtypes.split(","):
            dtype, _, group = wd.partition(":")  # int4:128, int4:row: another weight group
            b = CpuExpertBackend(
                args.threads, dtype, PER_ROW if group == "row" else int(group) if group else None
            )
            assert b.amx, "no AMX on this CPU (or the kernel refused it)"
            p13, p2 = b.pack_weights(w13, w2)
            b.gemv_max_tokens = 0
            per_expert = p13[0].numel() * p13.element_size() + p2[0].numel() * p2.element_size()
            # --layers: each call on the next of several copies (a model's layers: no copy is in a
            # cache when its turn comes, so no flush is needed and the team stays warm)
            l13 = [p13, *(p13.clone() for _ in range(args.layers - 1))]
            l2 = [p2, *(p2.clone() for _ in range(args.layers - 1))]
            for t in [int(v) for v in args.tokens.split(",")]:
                # top-k of all e experts; a server holding the first `held` sees the rest as -1
                routes = []
                for _ in range(16):
                    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
                    routes.append((torch.where(ids < held, ids, -1), torch.rand(t, k)))
                x = torch.randn(t, h, generator=g).bfloat16()
                ref = TorchExpertBackend().forward(x, w13, w2, *routes[0]).float()
                active = sum(len(torch.unique(r[0][r[0] >= 0])) for r in routes) / len(routes)
                flops = 2 * t * k * 3 * h * i
                combos = {n: (lib, l13, l2) for n, lib in timed.items()}
                if args.pad and wd == "bfloat16":
                    combos |= {n + "+pad": (lib, [padded(p13)], [padded(p2)]) for n, lib in timed.items()}
                times: dict[str, list[float]] = {n: [] for n in combos}
                errs = {}
                for n, (lib, a, c) in combos.items():
                    b.lib = lib
                    errs[n] = (
                        (b.forward(x, a[0], c[0], *routes[0]).float() - ref).norm() / ref.norm()
                    ).item()
                for _ in range(args.rounds):
                    for n, (lib, a, c) in combos.items():
                        b.lib = lib
                        times[n].append(timeit(runner(b, x, a, c, routes), args.reps, 2.0))
                stage_ms = {}
                for n in timed:
                    prof = libs.get(n + "+prof")
                    if prof is None:
                        continue
                    b.lib = prof
                    stages = (ctypes.c_double * len(STAGES))()
                    run = runner(b, x, l13, l2, routes)
                    timeit(run, 1, 0.0)
                    prof.moe_amx_profile(stages)  # drop the warm-up
                    for r in range(args.reps):
                        run(r)
                    prof.moe_amx_profile(stages)
                    stage_ms[n] = {s: round(v * 1e3 / args.reps, 3) for s, v in zip(STAGES, stages)}
                floor_bw = active * per_expert / (info["read_GBps"] * 1e9)
                for n in combos:
                    med = sorted(times[n])[len(times[n]) // 2]
                    rows.append(
                        {
                            "model": name, "T": t, "weights": wd, "build": n, "ms": med * 1e3,
                            "ms_rounds": [round(v * 1e3, 3) for v in times[n]],
                            "TFLOPs": flops / med / 1e12,
                            "pct_read_bw": 100 * floor_bw / med,
                            "vs_peak_bf16": info.get("peak_bfloat16_TFLOPs", float("nan")) / (flops / med / 1e12),
                            "bw_floor_ms": floor_bw * 1e3, "rel_err": errs[n],
                            "stages_ms(profile build)": stage_ms.get(n),
                        }
                    )  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default="64,512")
    p.add_argument(
        "--dtypes", default="bfloat16,int8", help="weight formats, DTYPE or DTYPE:GROUP (int4:128, int4:row)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--baseline", default=None, help="moe_gemv.c of another copy of the kernels")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME[@moe_gemv.c of another copy][:MACRO[=V][;MACRO...]] build",
    )
    p.add_argument("--skip-peak", action="store_true")
    p.add_argument("--no-profile", action="store_true", help="no AMX_PROFILE build of each variant")
    p.add_argument(
        "--flush", action="store_true", help="read twice the L3 before each timed call (bench_cpu_experts)"
    )
    p.add_argument("--pad", action="store_true", help="also time bf16 rows at a stride one cache line longer")
    p.add_argument(
        "--layers",
        type=int,
        default=1,
        help="cycle the calls over this many copies of the weights (decode's pattern)",
    )
    p.add_argument(
        "--call", choices=("forward", "server"), default="forward", help="what a timed call runs (runner)"
    )
    p.add_argument(
        "--held",
        type=int,
        default=None,
        help="the server holds only the first N experts (the rest route as -1)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.pad and args.layers > 1:
        p.error("--pad times one copy of the weights: leave --layers out")
    global CALL
    CALL = args.call
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    info = host_info() | dram_bandwidth() | ({} if args.skip_peak else gemm_peak(args.threads))
    if args.flush:  # timeit reads it before every timed call, as in bench_cpu_experts' default protocol
        bench_cpu_experts.FLUSH = torch.ones(2 * l3_bytes() // 4)
        info["flush_MiB"] = 2 * l3_bytes() // 2**20
    print(json.dumps(info), flush=True)
    libs = variant_libs(variant_defines(args.baseline, args.variant), not args.no_profile)
    rows = bench(args, info, libs)
    print(
        "| model | T | weights | build | ms (rounds) | TFLOP/s | x below bf16 peak | % read BW | stages ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        st = r["stages_ms(profile build)"]
        print(
            f"| {r['model']} | {r['T']} | {r['weights']} | {r['build']} | {r['ms']:.2f} {r['ms_rounds']} "
            f"| {r['TFLOPs']:.2f} | {r['vs_peak_bf16']:.2f} | {r['pct_read_bw']:.0f}% "
            f"| {' / '.join(f'{v:.2f}' for v in st.values()) if st else ''} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"host": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
