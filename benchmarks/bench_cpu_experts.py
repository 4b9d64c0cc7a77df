"""Per-layer routed-expert time on the CPU: the CPU backend (bf16/int8/int4) vs the torch reference.

One MoE layer with every expert resident, fresh random top-k routing per repetition, real model
widths, random weights. Before each timed call a buffer of twice the L3 is read (untimed), so the
active experts come from DRAM as in a real model, whose other layers pass through the caches
between two uses of this one (the lent host's 300 MiB L3 holds most of an int4 Qwen3-30B-A3B
layer; without the flush, smaller formats would be timed partly from cache; --warm turns it off).
The flush evicts the code too: the Python, torch and ctypes code of the call and the data they
touch, which in a server stays warm because every layer runs it. --warm-code makes one untimed
call of the same path with no local expert (all slot ids -1: no weights read) after the flush,
so the timed call finds the code and the thread team warm and its weights in DRAM (
the glue costs ~50 us of a 0.38 ms int4 layer after the plain flush). Alongside: the host's
measured DRAM bandwidth (threaded torch copy and read of 1 GiB)
and GEMM peak (a large torch matmul), torch's own decode-shaped GEMV per expert in bf16 and
fp32, and the CPU's ISA flags.

    python benchmarks/bench_cpu_experts.py --threads 16 --out results.json

Columns: ms = per-layer expert time; GB/s = bytes of the active experts' weights (in the format
used) per second; %BW = that over the measured read bandwidth; TFLOP/s = 2*T*K*3*H*I / time;
tok/s = T / time; rel err = ||out - ref|| / ||ref|| against the torch reference on the bf16
weights (for int8/int4 this is the quantisation error, weights and activations). Rows with a
suffix force one path: "/kernel" the decode kernel, "/amx" the AMX prefill kernel, "/gemm" torch
GEMMs per expert, "/fp32dot" the decode kernel's fp32 dot products (weights converted in
registers: the pre-VNNI int8/int4 path, and bf16 without vdpbf16ps).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from cpu_expert_server import kernels
from cpu_expert_server.backend import CpuExpertBackend
from expertmesh.experts import TorchExpertBackend

MODELS = {  # name: (H, I, experts, top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
}


BUDGET_S = 2.0
CAPS = kernels.cpu_caps()
FLUSH: torch.Tensor | None = None  # read before each timed call (None: --warm)
WARM_CODE = False  # --warm-code: fn(-1) (the same path, no local expert) after the flush
CALL = "server"  # --call: what one timed rep runs (call_of)


def l3_bytes() -> int:
    """The largest L3 of this host per sysfs (256 MiB when it does not say)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        if (f.parent / "level").read_text().strip() == "3":
            v = f.read_text().strip()
            sizes.append(
                int(v[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[v[-1]] if v[-1] in "KMG" else int(v)
            )
    return max(sizes, default=256 * 2**20)


def timeit(
    fn: Callable[[int], object], reps: int, budget_s: float | None = None, flush: bool = True
) -> float:
    """Median seconds of ``fn(rep)`` over up to ``reps`` calls (fewer when their time passes
    ``budget_s``), each after the cache flush unless ``flush`` is off or --warm."""
    budget_s = BUDGET_S if budget_s is None else budget_s
    fn(0)
    times: list[float] = []
    for r in range(reps):
        if flush and FLUSH is not None:
            FLUSH.sum()
            if WARM_CODE:
                fn(-1)
        t0 = time.perf_counter()
        fn(r + 1)
        times.append(time.perf_counter() - t0)
        if sum(times) > budget_s and len(times) >= 3:
            break
    return sorted(times)[len(times) // 2]


def timeit_interleaved(fns: list[Callable[[int], object]], reps: int) -> list[float]:
    """Median seconds of each of ``fns`` timed round robin (rep r of every fn before rep r + 1 of
    any), each call after the cache flush, so that drift of the host's speed within the run hits
    every variant alike; up to ``reps`` rounds within the time budget."""
    for fn in fns:
        fn(0)
    times: list[list[float]] = [[] for _ in fns]
    spent = 0.0
    for r in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            if FLUSH is not None:
                FLUSH.sum()
                if WARM_CODE:
                    fn(-1)
            t0 = time.perf_counter()
            fn(r + 1)
            ts.append(time.perf_counter() - t0)
            spent += ts[-1]
        if spent > BUDGET_S * len(fns) and r >= 2:
            break
    return [sorted(ts)[len(ts) // 2] for ts in times]


def call_of(backend, a, b, x, routes_of, wire_of) -> Callable[[int], torch.Tensor]:
    """What one timed rep runs. --call forward (the earlier tables' protocol):
    ``backend.forward`` on int64 routing tensors. --call server (the default):
    the CPU expert server's own call on its fast paths (ExpertWorker._compute_locked): the routing as the wire brings it (int32
    ids, float32 weights, host tensors), the answer written into the ring (a
    preallocated tensor) by the backend's ``forward_into`` where it takes the call, else
    ``forward`` on the routing tensors and a copy into the ring."""
    if CALL == "forward":
        return lambda r: backend.forward(x, a, b, *routes_of(r))
    ring, cpu = torch.empty_like(x), torch.device("cpu")
    into = getattr(backend, "forward_into", None)

    def serve(r: int) -> torch.Tensor:
        ids, w = wire_of(r)
        # EXPERTMESH_BENCH_NO_INTO=1 (a --variants switch): the server's call without forward_into
        if into is None or "EXPERTMESH_BENCH_NO_INTO" in os.environ or not into(x, a, b, ids, w, ring):
            y = backend.forward(
                x.to(cpu, non_blocking=True),
                a,
                b,
                ids.to(cpu, non_blocking=True),
                w.to(cpu, non_blocking=True),
            )
            ring.copy_(y)
        return ring

    return serve


def with_env(fn: Callable[[int], object], env: dict[str, str]) -> Callable[[int], object]:
    """``fn`` run with these environment variables set (the int8/int4 decode kernel's switches,
    EXPERTMESH_QDOT_*, read at every call), then unset."""

    def run(r: int) -> object:
        os.environ.update(env)
        try:
            return fn(r)
        finally:
            for k in env:
                os.environ.pop(k, None)

    return run


def parse_variants(splits: str, variants: str) -> dict[str, dict[str, str]]:
    """--qdot-splits "0,3" and --variants "name:VAR=V,VAR=V;name2:" -> {row tag: environment}
    ("name:" with nothing after it: the kernel's defaults)."""
    out = {f"split{v}": {"EXPERTMESH_QDOT_SPLIT": v} for v in splits.split(",") if v}
    for item in filter(None, variants.split(";")):
        name, _, env = item.partition(":")
        out[name] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    return out


def host_info() -> dict:
    flags: set[str] = set()
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
    isa = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "avx_vnni"))
    return {"cpu": model, "threads": torch.get_num_threads(), "isa": isa, "torch": torch.__version__}


def dram_bandwidth() -> dict:
    a = torch.ones(2**28)  # 1 GiB of fp32: far past any L3
    b = torch.empty_like(a)
    copy = timeit(lambda _: b.copy_(a), 10, flush=False)
    read = timeit(lambda _: a.sum(), 10, flush=False)
    nbytes = a.numel() * 4
    return {"copy_GBps": 2 * nbytes / copy / 1e9, "read_GBps": nbytes / read / 1e9}


# torch GEMM shapes (m, n, k) for the peak: square ones, a wide one, and one with few rows
PEAK_SHAPES = ((2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 2048), (512, 8192, 4096))


def gemm_peak(threads: int, rounds: int = 3) -> dict:
    """The host's bf16 (and fp32) GEMM peak, measured in this run: torch GEMMs (oneDNN / MKL) at
    several shapes and at all and half the threads, each timed ``rounds`` times interleaved (the
    VM's rate moves between runs and within one); ``peak_bf16_TFLOPs`` is the best of all, with
    the spread of the best configuration's rounds and of the configurations' bests. Then the AMX
    tiles' own arithmetic rate (:func:`amx_peak`), which no GEMM with memory traffic reaches.
    Also one expert's prefill shape (32 tokens x [2048 -> 1536]) to show the small-GEMM cost."""
    out: dict = {}
    runs: dict[str, list[float]] = {}
    for dt in (torch.bfloat16, torch.float32):
        name = str(dt)[6:]
        shapes = PEAK_SHAPES if dt == torch.bfloat16 else PEAK_SHAPES[1:2]
        for _ in range(rounds if dt == torch.bfloat16 else 1):
            for nt in sorted({threads, max(1, threads // 2)}, reverse=True):
                torch.set_num_threads(nt)
                for m, n, k in shapes:
                    a, b = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
                    sec = timeit(lambda _, a=a, b=b: a @ b, 5, 1.0)
                    runs.setdefault(f"gemm_{name}_{m}x{n}x{k}_t{nt}", []).append(2 * m * n * k / sec / 1e12)
        torch.set_num_threads(threads)
        a, b = torch.randn(32, 2048).to(dt), torch.randn(2048, 1536).to(dt)
        sec = timeit(lambda _, a=a, b=b: a @ b, 20, 0.5)
        out[f"gemm_{name}_32x1536x2048_TFLOPs"] = 2 * 32 * 1536 * 2048 / sec / 1e12
        mine = {key: v for key, v in runs.items() if key.startswith(f"gemm_{name}_")}
        best = max(mine, key=lambda key: max(mine[key]))
        out[f"peak_{name}_TFLOPs"] = max(mine[best])
        out[f"peak_{name}_config"] = best
        out[f"peak_{name}_rounds_TFLOPs"] = [round(v, 3) for v in mine[best]]
        out[f"peak_{name}_config_bests_TFLOPs"] = sorted(round(max(v), 3) for v in mine.values())
    out["gemm_runs_TFLOPs"] = {key: [round(v, 3) for v in vals] for key, vals in runs.items()}
    return out | amx_peak(threads)


def amx_peak(threads: int) -> dict:
    """TFLOP/s (int8: TOP/s) of back-to-back tile products on this CPU's AMX units (the C
    kernels' moe_amx_peak): 4 independent accumulators, operands in tile registers ("regs") or
    reloaded from L1 before every step as the kernel's inner loop does ("l1"); 1, half and all
    threads. Empty without AMX."""
    lib = kernels.load()
    if lib is None or not CAPS & kernels.CAPS["amx"][0] or lib.moe_amx_init() != 0:
        return {}
    out = {}
    for int8 in (0, 1):
        for reload in (0, 1):
            for nt in sorted({1, max(1, threads // 2), threads}):
                iters = 1 << 20
                sec = lib.moe_amx_peak(int8, reload, iters, nt)
                ops = nt * iters * 4 * 16 * 16 * (64 if int8 else 32) * 2
                tag = f"amx_{'int8' if int8 else 'bf16'}_{'l1' if reload else 'regs'}_t{nt}"
                out[tag + ("_TOPs" if int8 else "_TFLOPs")] = ops / sec / 1e12
    return out


def torch_gemv(h: int, i: int, e: int, k: int) -> dict:
    """torch's own per-expert decode GEMV [2I, H] @ x over K distinct experts, in GB/s."""
    out = {}
    for dt in (torch.bfloat16, torch.float32):
        w = torch.randn(e, 2 * i, h).to(dt)
        x = torch.randn(1, h).to(dt)
        picks = [torch.randperm(e)[:k].tolist() for _ in range(64)]
        s = timeit(lambda r, x=x, w=w, p=picks: [F.linear(x, w[j]) for j in p[r % 64]], 30)
        out[f"gemv_{str(dt)[6:]}_GBps"] = k * w[0].numel() * w.element_size() / s / 1e9
    return out


def random_routes(
    e: int, k: int, t: int, g: torch.Generator, n: int = 16
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` routings of ``t`` tokens, each a uniform top-``k`` of ``e`` experts (int64 ids [T, K])
    with random weights [T, K]: a fresh one per timed repetition, as a real layer's calls."""
    return [
        (torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]), torch.rand(t, k, generator=g))
        for _ in range(n)
    ]


def bench_model(
    name: str,
    tokens: list[int],
    dtypes: list[str],
    threads: int,
    bw: float,
    reps: int,
    variants: dict[str, dict[str, str]] | None = None,
    only_modes: set[str] | None = None,
) -> list[dict]:
    h, i, e, k = MODELS[name]
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()  # [E, 2I, H]
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()  # [E, H, I]
    backends = {"torch-ref": (TorchExpertBackend(), w13, w2)}
    amx = False
    for wd in dtypes:
        b = CpuExpertBackend(threads, wd, caps=CAPS)
        backends[wd] = (b, *b.pack_weights(w13, w2))
        amx = b.amx
        print(json.dumps({"model": name, "weights": wd, "dot": b.dot_kind(), "amx": b.amx}), flush=True)
    rows = []
    for t in tokens:
        routes = random_routes(e, k, t, g)
        x = torch.randn(t, h, generator=g).bfloat16()
        # routes[-1 % 16] would be a real one: rep -1 (--warm-code's untimed call) gets no expert
        none = (torch.full((t, k), -1, dtype=torch.int64), torch.zeros(t, k))
        routes_of = lambda r, rs=routes, none=none: none if r < 0 else rs[r % 16]  # noqa: E731
        wire = [(ids.to(torch.int32), w.float()) for ids, w in routes]  # --call server's routing
        wire_none = (none[0].to(torch.int32), none[1])
        wire_of = lambda r, ws=wire, none=wire_none: none if r < 0 else ws[r % 16]  # noqa: E731
        n_active = sum(len(torch.unique(r[0])) for r in routes) / len(routes)
        ref = TorchExpertBackend().forward(x, w13, w2, *routes[0]).float()  # [T, H]
        for label, (backend, a, b) in backends.items():
            per_expert = (a[0].numel() * a.element_size() + b[0].numel() * b.element_size()) if len(a) else 0
            # past decode sizes also time the two paths the backend chooses between
            modes = [""]
            if isinstance(backend, CpuExpertBackend):
                if t >= 16 or amx:
                    modes.append("/kernel")
                if t >= 16:
                    modes.append("/gemm")
                if amx:
                    modes.append("/amx")
                if t <= 4 and backend.dot_kind() != "fp32":
                    modes.append("/fp32dot")
                if only_modes is not None:
                    modes = [m for m in modes if m in only_modes]
            for suffix in modes:
                if isinstance(backend, CpuExpertBackend):
                    force(backend, suffix, amx)
                fn = call_of(backend, a, b, x, routes_of, wire_of)
                err = ((fn(0).float() - ref).norm() / ref.norm()).item()
                s = timeit(fn, reps)
                rows.append(result_row(name, t, label + suffix, s, n_active * per_expert, bw, err))
        if variants:
            rows += split_rows(
                name, t, backends, variants, amx, x, routes_of, wire_of, ref, n_active, bw, reps
            )
    return rows


def split_rows(
    name, t, backends, variants, amx, x, routes_of, wire_of, ref, n_active, bw, reps
) -> list[dict]:
    """The int8/int4 decode kernel's variants (environment switches: work splits
    EXPERTMESH_QDOT_SPLIT, EXPERTMESH_QDOT_CHAIN/_CLAIM/_Q512) timed round robin with
    the bf16 default path ("bfloat16/il") in one interleaved group, each with the backend's own
    path choice: rows "<dtype>/<variant>" (--qdot-splits N: "split<N>")."""
    group = []
    for label, (backend, a, b) in backends.items():
        if not isinstance(backend, CpuExpertBackend):
            continue
        force(backend, "", amx)
        # bf16 takes the variants that switch the benchmark's own call (EXPERTMESH_BENCH_*) too
        bench_only = {
            f"il-{n}": e
            for n, e in variants.items()
            if e and all(k.startswith("EXPERTMESH_BENCH_") for k in e)
        }
        mine = {"il": {}} | bench_only if label == "bfloat16" else variants
        for vname, env in mine.items():
            fn = with_env(call_of(backend, a, b, x, routes_of, wire_of), env)
            tag = f"{label}/{vname}"
            per_expert = a[0].numel() * a.element_size() + b[0].numel() * b.element_size()
            err = ((fn(0).float() - ref).norm() / ref.norm()).item()  # type: ignore[attr-defined]
            group.append((tag, fn, per_expert, err))
    secs = timeit_interleaved([fn for _, fn, _, _ in group], reps)
    rows = []
    for (tag, _, per_expert, err), s in zip(group, secs, strict=True):
        rows.append(result_row(name, t, tag, s, n_active * per_expert, bw, err))
    return rows


def result_row(name: str, t: int, tag: str, s: float, nbytes: int, bw: float, err: float) -> dict:
    """One timed path: ``s`` seconds per layer reading ``nbytes`` of active expert weights;
    printed as it is made (a long run shows its progress)."""
    h, i, _, k = MODELS[name]
    gbps = nbytes / s / 1e9
    row = {
        "model": name,
        "T": t,
        "weights": tag,
        "ms": s * 1e3,
        "GBps": gbps,
        "pct_bw": 100 * gbps / bw,
        "TFLOPs": 2 * t * k * 3 * h * i / s / 1e12,
        "tok_s": t / s,
        "rel_err": err,
    }
    print(json.dumps(row), flush=True)
    return row


def force(backend: CpuExpertBackend, suffix: str, amx: bool) -> None:
    """Point the backend at one path ("" = its own choice: gemv_max_tokens None)."""
    backend.gemv_max_tokens = {"": None, "/kernel": 10**9, "/fp32dot": 10**9}.get(suffix, 0)
    backend.amx = amx and suffix in ("", "/amx")
    backend.qact = suffix != "/fp32dot"
    full = CAPS
    backend.caps = full & ~kernels.CAPS["bf16"][0] if suffix == "/fp32dot" else full


def table(rows: list[dict]) -> str:
    lines = [
        "| model | T | weights | ms/layer | GB/s | %BW | TFLOP/s | tok/s | vs torch-ref | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = {(r["model"], r["T"]): r["ms"] for r in rows if r["weights"] == "torch-ref"}
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['T']} | {r['weights']} | {r['ms']:.2f} | {r['GBps']:.1f} | {r['pct_bw']:.0f}% "
            f"| {r['TFLOPs']:.2f} | {r['tok_s']:.0f} | {ref[(r['model'], r['T'])] / r['ms']:.1f}x | {r['rel_err']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default="1,4,16,64,512")
    p.add_argument("--dtypes", default="bfloat16,int8,int4")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-amx", action="store_true", help="leave the AMX prefill kernel out")
    p.add_argument("--budget-s", type=float, default=2.0, help="time cap per row (>= 3 reps)")
    p.add_argument("--out", default=None, help="write all measurements as JSON here")
    p.add_argument("--warm", action="store_true", help="no cache flush before the timed calls")
    p.add_argument(
        "--skip-peak",
        action="store_true",
        help="no GEMM peak (minutes in bf16 on CPUs without bf16 instructions)",
    )
    p.add_argument(
        "--qdot-splits",
        default="",
        help="also time these int8/int4 decode work splits (EXPERTMESH_QDOT_SPLIT values, e.g. "
        "0,1,2,3) round robin with the bf16 default path",
    )
    p.add_argument(
        "--variants",
        default="",
        help='int8/int4 decode variants timed like --qdot-splits: "name:VAR=V,VAR=V;name2:" '
        '(e.g. "default:;nochain:EXPERTMESH_QDOT_CHAIN=0"; "name:" = the kernel defaults)',
    )
    p.add_argument(
        "--warm-code",
        action="store_true",
        help="after each flush, one untimed call of the same path with no local expert (code and "
        "threads warm, weights cold, as after the previous layer in a server)",
    )
    p.add_argument(
        "--call",
        choices=("forward", "server"),
        default="server",
        help="what a timed call runs: the CPU server's own fast-path call (int32 routing, answer "
        "into the ring; call_of), or backend.forward on int64 routing (the earlier tables' protocol)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help="only these forced paths besides the default one, e.g. kernel,amx (default: all)",
    )
    args = p.parse_args()
    global BUDGET_S, CAPS, FLUSH, WARM_CODE, CALL
    BUDGET_S = args.budget_s
    CALL = args.call
    WARM_CODE = args.warm_code
    if not args.warm:
        FLUSH = torch.ones(2 * l3_bytes() // 4)  # fp32: twice the L3
    if args.no_amx:
        CAPS &= ~kernels.CAPS["amx"][0]
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    info = host_info() | dram_bandwidth() | ({} if args.skip_peak else gemm_peak(threads))
    info["flush_MiB"] = 0 if FLUSH is None else FLUSH.numel() * 4 // 2**20
    info["warm_code"] = WARM_CODE
    info["call"] = CALL
    print(json.dumps(info), flush=True)
    models = args.models.split(",")
    info |= torch_gemv(*MODELS[models[0]])
    print(json.dumps(info), flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    variants = parse_variants(args.qdot_splits, args.variants)
    for m in models:
        only = None if args.modes is None else {""} | {"/" + v for v in args.modes.split(",") if v}
        rows += bench_model(
            m, tokens, args.dtypes.split(","), threads, info["read_GBps"], args.reps, variants, only
        )
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"host": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
