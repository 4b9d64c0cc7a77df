"""expertmesh's CPU expert kernels against KTransformers' kt-kernel, one MoE layer at real widths.

Both run the same bf16 weights (random from one seed, [E, I, H] gate and up, [E, H, I] down), the
same routes (a fresh uniform top-k per repetition) and the same hidden states, each call after a
read of twice the L3, so weights come from DRAM as in a server. Each side runs in a process of
its own (kt-kernel's worker threads keep spinning between calls and would take the cores from
expertmesh's team; ``--isolate 0`` puts both in one process), ``--isolate N`` passes of the two
processes one after the other; within a process its methods are timed round robin (rep r of every
method before rep r + 1 of any). A cell is the fastest pass's median (every pass in the JSON). expertmesh's rows time the CPU server's own call (the routing as
the wire brings it, the answer into the ring); kt-kernel's time ``CPUInfer.submit(forward_task)``
and ``sync()``, the call its Python wrapper makes per layer, on the buffers that wrapper uses.

Formats, so the rows compare like with like:
  em-int4      expertmesh int4, groups of 64 along each row (the server's default)
  em-int4-row  expertmesh int4, one scale per row (``cpu-server --weight-group row``)
  em-int4-bt   em-int4 with activations unquantised (``qact=False``): AMX prefill dequantises each
               block of rows to bf16 and runs bf16 tiles (no fold per group); decode, fp32 dots
  em-int8      expertmesh int8, groups of 128
  em-bf16      expertmesh bf16
  kt-AMXINT4   kt-kernel AMXInt4_MOE: int4 with one scale per output row (per channel)
  kt-AMXINT4-G32   kt-kernel AMXInt4_KGroup_MOE (its Kimi-K2 class): int4 in groups of 32 along
               each row, quantised here (kt-kernel takes this format pre-quantised), below
  kt-AMXINT4-G64   the same in groups of 64 (em-int4's format), kt-AMXINT4-G128 of 128 (em-int4-g128's);
               kt-kernel 0.7.2 computed NaN with these two and crashed at prefill sizes (measured)
  em-int4-g128 expertmesh int4, groups of 128 (``cpu-server --weight-group 128``)
  kt-AMXINT8   kt-kernel AMXInt8_MOE: int8, one scale per output row
  kt-AMXBF16   kt-kernel AMXBF16_MOE
kt-kernel quantises the bf16 weights itself at load (its online path), except for the grouped
int4 rows: their weights are quantised by ``kt_int4_groups`` into the layout kt-kernel's own
examples write for that class (symmetric, scale = max |w| / 7 per group, bf16 scales, q + 8 eight
to an int32). rel err: against the
torch reference on the bf16 weights (random Gaussian weights have none of the outlier rows that
make one scale per row costly in real checkpoints: the column says the kernels compute what they
should, not which format is more accurate).

kt-kernel is not a dependency: ``--kt-dir`` names a folder holding its wheel's ``kt_kernel/``
and ``kt_kernel.libs/`` (``pip download kt-kernel==0.7.2 --no-deps`` and unzip); only the compiled
module of this CPU's variant (``--kt-variant``, default amx) is loaded, not the package.

    python benchmarks/bench_kt_kernel.py --kt-dir /tmp/kt --threads 28 --tokens 1,16,64,128,512 \\
        --methods em-int4,em-int4-row,kt-AMXINT4
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from benchmarks import bench_cpu_experts as bce
from cpu_expert_server.backend import CpuExpertBackend
from expertmesh.experts import TorchExpertBackend

EM = {  # method: (weight dtype, group; None = the default, 0 = one scale per row)
    "em-int4": ("int4", None),
    "em-int4-row": ("int4", 0),
    "em-int4-bt": ("int4", None),  # activations unquantised: prefill dequantises rows onto bf16 tiles
    "em-int4-g128": ("int4", 128),
    "em-int8": ("int8", None),
    "em-bf16": ("bfloat16", None),
}
KT = {
    "kt-AMXINT4": "AMXInt4_MOE",
    "kt-AMXINT8": "AMXInt8_MOE",
    "kt-AMXBF16": "AMXBF16_MOE",
    "kt-AVX2BF16": "AVX2BF16_MOE",  # no AMX: runs on any AVX2 host (the harness itself on a VM)
    "kt-AMXINT4-G32": "AMXInt4_KGroup_MOE",
    "kt-AMXINT4-G64": "AMXInt4_KGroup_MOE",
    "kt-AMXINT4-G128": "AMXInt4_KGroup_MOE",
}
KT_GROUP = {"kt-AMXINT4-G32": 32, "kt-AMXINT4-G64": 64, "kt-AMXINT4-G128": 128}  # pre-quantised int4
DEFAULT_METHODS = "em-int4,em-int4-row,em-int8,kt-AMXINT4,kt-AMXINT8"


class ThreadedFlush:
    """The cache flush before each timed call, read by a few plain threads that block when done.
    After torch's own reduction as the flush, every kt-kernel call took ~12 ms whatever its size
    (measured; by our reading torch's OpenMP team spins on after the read and kt-kernel's workers,
    bound to cores, wait for those cores); ``sum()`` as bench_cpu_experts calls it."""

    def __init__(self, nbytes: int, threads: int = 8) -> None:
        self.chunks = np.array_split(np.ones(nbytes // 4, dtype=np.float32), threads)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="flush")

    def sum(self) -> float:
        return float(sum(self.pool.map(np.sum, self.chunks)))


def load_kt(kt_dir: str, variant: str):
    """kt-kernel's compiled module for ``variant`` (its package imports gguf and more; the
    module alone needs only kt_kernel.libs/ beside it)."""
    found = glob.glob(os.path.join(kt_dir, "kt_kernel", f"_kt_kernel_ext_{variant}.*.so"))
    if not found:
        raise SystemExit(f"no kt_kernel/_kt_kernel_ext_{variant}.*.so under {kt_dir}")
    spec = importlib.util.spec_from_file_location("kt_kernel_ext", found[0])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kt_int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] -> (int32 [E, rows, cols / 8], bf16 scales [E, rows, cols / group]): int4 q
    in [-8, 7] with scale max |w| / 7 per group of ``group`` inputs, stored as q + 8, input j of a
    word at bits 4 * (j % 8)."""
    e, r, c = w.shape
    x = w.float().view(e, r, c // group, group)
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 7.0
    q = (torch.round(x / scale).clamp(-8, 7) + 8).to(torch.int32).view(e, r, c // 8, 8)
    # the nibbles' fields do not overlap, so the int32 sum (wrapping at bit 31) is their bitwise or
    words = (q << (torch.arange(8, dtype=torch.int32) * 4)).sum(-1, dtype=torch.int32)
    return words.contiguous(), scale.squeeze(-1).bfloat16().contiguous()


class KtLayer:
    """One kt-kernel MoE layer: its worker pool, the layer quantised from bf16 (or by
    kt_int4_groups when ``group`` is set), its buffers."""

    def __init__(self, ext, cls_name: str, pool, gate, up, down, k: int, max_len: int, tmp: str,
                 group: int | None = None):  # fmt: skip
        e, i, h = gate.shape
        if group:
            packed = [kt_int4_groups(t, group) for t in (gate, up, down)]
            self.keep = [p[0] for p in packed] + [p[1] for p in packed]
        else:
            self.keep = [gate.contiguous(), up.contiguous(), down.contiguous()]
        self.mask = torch.zeros(e, dtype=torch.bool)  # no expert on a GPU
        cfg = ext.moe.MOEConfig(e, k, h, i, self.mask.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len = 0, pool.backend_, max_len
        cfg.save, cfg.load, cfg.path = False, False, tmp
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = (t.data_ptr() for t in self.keep[:3])
        if group:
            cfg.gate_scale, cfg.up_scale, cfg.down_scale = (t.data_ptr() for t in self.keep[3:])
            cfg.quant_config.bits, cfg.quant_config.group_size, cfg.quant_config.zero_point = 4, group, False
        self.pool, self.moe, self.k, self.h = pool, getattr(ext.moe, cls_name)(cfg), k, h
        self.p2l = torch.arange(e, dtype=torch.int64)
        pool.submit(self.moe.load_weights_task(self.p2l.data_ptr()))
        pool.sync()

    def call(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        bsz = torch.tensor([x.shape[0]], dtype=torch.int32)
        task = self.moe.forward_task(
            bsz.data_ptr(), self.k, ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr(), False
        )
        self.pool.submit(task)
        self.pool.sync()
        return out


def kt_pool(ext, threads: int):
    cfg = ext.WorkerPoolConfig()
    cfg.subpool_count, cfg.subpool_numa_map, cfg.subpool_thread_count = 1, [0], [threads]
    return ext.CPUInfer(cfg)


def bench(
    model: str,
    methods: list[str],
    tokens: list[int],
    threads: int,
    reps: int,
    kt_dir: str | None,
    kt_variant: str,
    bw: float,
) -> list[dict]:
    h, i, e, k = bce.MODELS[model]
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(e, i, h, generator=g) / h**0.5).bfloat16()
    up = (torch.randn(e, i, h, generator=g) / h**0.5).bfloat16()
    down = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    w13 = torch.cat([gate, up], dim=1)  # [E, 2I, H]
    layers: dict[str, tuple] = {}
    for m in methods:
        if m in EM:
            wd, group = EM[m]
            b = CpuExpertBackend(threads, wd, group=max(h, i) if group == 0 else group, caps=bce.CAPS)
            a, c = b.pack_weights(w13, down)
            b.qact = m != "em-int4-bt"
            per_expert = a[0].numel() * a.element_size() + c[0].numel() * c.element_size()
            layers[m] = ("em", b, a, c, per_expert)
            print(
                json.dumps(
                    {
                        "model": model,
                        "method": m,
                        "dot": b.dot_kind(),
                        "amx": b.amx,
                        "groups": [b.fmt.g13, b.fmt.g2] if b.fmt else None,
                    }
                ),
                flush=True,
            )
    if any(m in KT for m in methods):
        assert kt_dir  # main() refuses kt-* methods without it
        ext = load_kt(kt_dir, kt_variant)
        pool = kt_pool(ext, threads)
        tmp = tempfile.mkdtemp(prefix="kt-")
        for m in methods:
            if m in KT:
                group = KT_GROUP.get(m)
                layer = KtLayer(ext, KT[m], pool, gate, up, down, k, max(tokens), tmp, group)
                if group:  # bf16 scales per group
                    per = (0.5 + 2 / group) * 3 * h * i
                else:  # fp32 scales per row
                    per = {"kt-AMXINT4": 0.5, "kt-AMXINT8": 1.0}.get(m, 2.0) * 3 * h * i + 4 * (2 * i + h)
                layers[m] = ("kt", layer, None, None, per)
    rows = []
    for t in tokens:
        routes = bce.random_routes(e, k, t, g)
        x = torch.randn(t, h, generator=g).bfloat16()
        ref = TorchExpertBackend().forward(x, w13, down, *routes[0]).float()
        n_active = sum(len(torch.unique(r[0])) for r in routes) / len(routes)
        none = (torch.full((t, k), -1, dtype=torch.int64), torch.zeros(t, k))
        # the routing as each side takes it: the wire's int32 ids (expertmesh), int64 (kt-kernel)
        wire = [(ids.to(torch.int32), w.float()) for ids, w in routes]
        wire_none = (none[0].to(torch.int32), none[1])
        kt_routes = [(ids.contiguous(), w.float().contiguous()) for ids, w in routes]
        fns = []
        for m in methods:
            kind, obj, a, c, _ = layers[m]
            if kind == "em":
                fns.append(
                    bce.call_of(
                        obj,
                        a,
                        c,
                        x,
                        lambda r, rs=routes, none=none: none if r < 0 else rs[r % 16],
                        lambda r, ws=wire, wn=wire_none: wn if r < 0 else ws[r % 16],
                    )
                )
            else:
                out = torch.zeros(t, h, dtype=torch.bfloat16)
                fns.append(
                    lambda r, layer=obj, rs=kt_routes, out=out, x=x, none=none: layer.call(
                        x, *(none if r < 0 else rs[r % 16]), out
                    )
                )
        errs = [((fn(0).float() - ref).norm() / ref.norm()).item() for fn in fns]
        times = bce.timeit_interleaved(fns, reps)
        for m, s, err in zip(methods, times, errs, strict=True):
            nbytes = n_active * layers[m][4]
            rows.append(
                {
                    "model": model,
                    "T": t,
                    "method": m,
                    "ms": round(s * 1e3, 4),
                    "tok_s": round(t / s, 1),
                    "TFLOPs": round(2 * t * k * 3 * h * i / s / 1e12, 3),
                    "GBps": round(nbytes / s / 1e9, 1),
                    "pct_bw": round(100 * nbytes / s / 1e9 / bw, 1) if bw else None,
                    "rel_err": float(f"{err:.3g}"),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


WRONG_ERR = 0.5  # rel err past which a row's results are wrong, not merely quantised (int4: ~0.2-0.3)


def table(rows: list[dict], methods: list[str]) -> str:
    """ms per layer by (model, T), each expertmesh row's speed over the kt-kernel rows of its
    format family beside it (x > 1: expertmesh faster): kt-kernel's per-row int4, then, where
    measured, its grouped int4: in the same groups ("same groups") or in groups of 32 ("kt g32").
    A row whose rel err is not finite or over WRONG_ERR is marked WRONG."""
    pair = {
        "em-int4": "kt-AMXINT4",
        "em-int4-row": "kt-AMXINT4",
        "em-int4-bt": "kt-AMXINT4",
        "em-int4-g128": "kt-AMXINT4",
        "em-int8": "kt-AMXINT8",
        "em-bf16": "kt-AMXBF16",
    }
    grouped = {
        "em-int4": [("same groups", "kt-AMXINT4-G64"), ("kt g32", "kt-AMXINT4-G32")],
        "em-int4-g128": [("same groups", "kt-AMXINT4-G128"), ("kt g32", "kt-AMXINT4-G32")],
    }
    cells: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["model"], r["T"]), {})[r["method"]] = r
    out = ["| model | T | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for (model, t), by in cells.items():
        parts = []
        for m in methods:
            r = by.get(m)
            if r is None:
                parts.append("")
                continue
            ratios = [f"{kt['ms'] / r['ms']:.2f}x" for kt in (by.get(pair.get(m, "")),) if kt]
            ratios += [
                f"{label} {by[kt]['ms'] / r['ms']:.2f}x" for label, kt in grouped.get(m, []) if kt in by
            ]
            err = r.get("rel_err", 0.0)
            wrong = f" WRONG (rel err {err})" if not math.isfinite(err) or err > WRONG_ERR else ""
            parts.append(f"{r['ms']:.3f}" + (f" ({'; '.join(ratios)})" if ratios else "") + wrong)
        out.append(f"| {model} | {t} | " + " | ".join(parts) + " |")
    return "\n".join(out)


def child_rows(cmd: list[str]) -> tuple[list[dict], int]:
    """Runs one side's process, echoing its output, and returns the rows it printed (the timed
    ones: JSON with T, method and ms) and its exit status: a process that dies part way (kt-kernel
    0.7.2's grouped int4 did, at groups of 64) still gives the rows it printed before."""
    rows = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.startswith("{"):
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if {"T", "method", "ms"} <= r.keys():
                    rows.append(r)
    return rows, proc.returncode


def isolated(args: argparse.Namespace, methods: list[str]) -> list[dict]:
    """Each side's methods in a process of its own, ``args.isolate`` passes; rows carry every
    pass's ms (``ms_passes``) and the fastest as ``ms``. A side whose process fails is reported
    on stderr and the passes go on with the rows it gave."""
    sides = [[m for m in methods if m in EM], [m for m in methods if m in KT]]
    by: dict[tuple, dict] = {}
    for n in range(args.isolate):
        for side in filter(None, sides):
            cmd = [sys.executable, "-m", "benchmarks.bench_kt_kernel", *child_argv(args), "--methods",
                   ",".join(side), "--isolate", "0"]  # fmt: skip
            rows, rc = child_rows(cmd)
            if rc:
                how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"status {rc}"
                print(f"bench_kt_kernel: the process of {','.join(side)} (pass {n + 1}) ended with {how}; "
                      f"{len(rows)} of its rows came before", file=sys.stderr)  # fmt: skip
            for r in rows:
                key = (r["model"], r["T"], r["method"])
                row = by.setdefault(key, {**r, "ms_passes": []})
                row["ms_passes"].append(r["ms"])
                if r["ms"] <= min(row["ms_passes"]):
                    row.update({k: v for k, v in r.items() if k != "ms_passes"})
    return list(by.values())


def child_argv(args: argparse.Namespace) -> list[str]:
    out = ["--threads", str(args.threads), "--models", args.models, "--tokens", args.tokens, "--reps",
           str(args.reps), "--budget-s", str(args.budget_s), "--kt-variant", args.kt_variant]  # fmt: skip
    if args.kt_dir:
        out += ["--kt-dir", args.kt_dir]
    if args.warm:
        out.append("--warm")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kt-dir", default=None, help="folder with kt-kernel's kt_kernel/ and kt_kernel.libs/")
    p.add_argument("--kt-variant", default="amx")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite")
    p.add_argument("--tokens", default="1,16,64,128,512")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"of {', '.join([*EM, *KT])}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=1.0, help="per method and T, seconds of timed calls")
    p.add_argument("--warm", action="store_true", help="no cache flush before each call")
    p.add_argument("--isolate", type=int, default=2, help="passes of one process per side (0: one process)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in EM and m not in KT]
    if unknown:
        p.error(f"unknown methods {unknown}")
    if any(m in KT for m in methods) and not args.kt_dir:
        p.error("the kt-* methods need --kt-dir (see the module's docstring)")
    if args.isolate:
        rows = isolated(args, methods)
        print(table(rows, methods))
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
        return
    torch.set_num_threads(args.threads)
    bce.BUDGET_S = args.budget_s
    bw = bce.dram_bandwidth()
    if not args.warm:
        bce.FLUSH = ThreadedFlush(2 * bce.l3_bytes())  # type: ignore[assignment]
    print(json.dumps({"host": bce.host_info(), "bandwidth": bw}), flush=True)
    rows = []
    for model in args.models.split(","):
        rows += bench(
            model,
            methods,
            [int(t) for t in args.tokens.split(",")],
            args.threads,
            args.reps,
            args.kt_dir,
            args.kt_variant,
            bw["read_GBps"],
        )
    print(table(rows, methods))
    if args.out:
        Path(args.out).write_text(json.dumps({"bandwidth": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
