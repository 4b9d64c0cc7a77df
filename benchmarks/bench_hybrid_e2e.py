"""End-to-end hybrid decode: coordinator on the GPU, a GPU expert server and a CPU expert server.

Random-weight Qwen3-30B-A3B widths (bf16; H 2048, 32/4 heads of 128, 128 experts, top-8, expert
I 768, vocab 151936) at two depths (default 1 and 4); the per-layer cost is the step-time
difference over the depth difference and tokens/s at the real depth (48) is
``batch / (fixed + 48 * per_layer)``, as in benchmarks/bench_e2e.py. Every row runs in the same process against the same two servers:

- ``gpu_all`` / ``cpu_all``: every expert on the GPU server / on the CPU server (baselines);
- ``hybrid G%``: ``--num-gpu-experts`` = G% of the experts, the rest on the CPU server;
- ``defer N``: the same with ``--cpu-defer-experts N`` (coordinator/deferral.py);
- ``cpu_share`` / ``gpu_share``: the hybrid placement with only the CPU (GPU) server's requests
  sent (the other share dropped; its numbers are wrong, its time is the one share alone).

Overlap ratio = hybrid per-layer time / max(cpu_share, gpu_share) per-layer time (1.0: the two
shares fully overlap; target <= 1.15). The mean round trip of each server's answers per layer
(from the submit to its answer) is printed beside, to see which side waits.

    python benchmarks/bench_hybrid_e2e.py --out DIR                 # on a CUDA machine
    python benchmarks/bench_hybrid_e2e.py --tiny --device cpu       # smoke test of the script

Shapes: B batch, E experts, K top-k, H hidden, I expert intermediate, V vocab.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.engine import Engine  # noqa: E402
from coordinator.kv_cache import KVCacheSpec  # noqa: E402
from coordinator.loader import load_model  # noqa: E402
from coordinator.remote import ClusterConfig, RemoteDispatcher, ServerSpec  # noqa: E402
from expertmesh.checkpoint import CheckpointReader  # noqa: E402
from tests.cluster_utils import start_server  # noqa: E402

QWEN3_30B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, inter=768,
                 vocab=151936, real_depth=48)  # fmt: skip
TINY = dict(
    hidden=128, heads=4, kv_heads=2, head_dim=32, experts=16, top_k=4, inter=64, vocab=512, real_depth=48
)


def _config(w: dict, depth: int) -> dict:
    return dict(
        model_type="qwen3_moe", vocab_size=w["vocab"], hidden_size=w["hidden"], intermediate_size=3 * w["hidden"],
        num_hidden_layers=depth, num_attention_heads=w["heads"], num_key_value_heads=w["kv_heads"],
        head_dim=w["head_dim"], moe_intermediate_size=w["inter"], num_experts=w["experts"],
        num_experts_per_tok=w["top_k"], norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False,
    )  # fmt: skip


def write_checkpoints(work: Path, w: dict, depths: tuple[int, ...]) -> dict[int, Path]:
    """One shard per layer plus one for embedding/norm/head, shared (symlinked) by a checkpoint
    directory per depth. Random bf16, scaled so activations stay O(1)."""
    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    h, e, i, hd = w["hidden"], w["experts"], w["inter"], w["head_dim"]
    # NOTE: tensors are tiled from one pool of normal samples (a different offset each): drawing
    # ~2 G fresh samples costs more device time than the whole timed part; the bytes moved,
    # which is what the timings depend on, are the same
    pool = torch.randn(1 << 22, generator=g)
    pools: dict[int, torch.Tensor] = {}  # fan_in -> scaled bf16 pool

    def rnd(*shape: int, fan_in: int) -> torch.Tensor:
        p = pools.setdefault(fan_in, (pool * fan_in**-0.5).bfloat16())
        n = torch.Size(shape).numel()
        start = int(torch.randint(0, p.numel(), (1,), generator=g))
        reps = -(-(n + start) // p.numel())
        return p.repeat(reps)[start : start + n].view(shape)

    shards: dict[str, dict[str, torch.Tensor]] = {
        "common.safetensors": {
            "model.embed_tokens.weight": rnd(w["vocab"], h, fan_in=1),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "lm_head.weight": rnd(w["vocab"], h, fan_in=h),
        }
    }
    for layer in range(max(depths)):
        p = f"model.layers.{layer}."
        shards[f"layer{layer}.safetensors"] = {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rnd(w["heads"] * hd, h, fan_in=h),
            p + "self_attn.k_proj.weight": rnd(w["kv_heads"] * hd, h, fan_in=h),
            p + "self_attn.v_proj.weight": rnd(w["kv_heads"] * hd, h, fan_in=h),
            p + "self_attn.o_proj.weight": rnd(h, w["heads"] * hd, fan_in=w["heads"] * hd),
            p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            p + "mlp.gate.weight": rnd(e, h, fan_in=h),
            p + "mlp.experts.gate_up_proj": rnd(e, 2 * i, h, fan_in=h),
            p + "mlp.experts.down_proj": rnd(e, h, i, fan_in=i),
        }
    for name, tensors in shards.items():
        save_file(tensors, str(work / name))
    out = {}
    for depth in depths:
        d = work / f"L{depth}"
        d.mkdir(exist_ok=True)
        files = ["common.safetensors"] + [f"layer{x}.safetensors" for x in range(depth)]
        weight_map = {n: f for f in files for n in shards[f]}
        for f in files:
            if not (d / f).exists():
                os.symlink(work / f, d / f)
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (d / "config.json").write_text(json.dumps(_config(w, depth)))
        out[depth] = d
    return out


class ShareDispatcher(RemoteDispatcher):
    """Sends only the ``share`` (``"cpu"`` / ``"gpu"``) servers' requests of each layer: the
    time of one share alone under the hybrid placement. ``"all"``: the plain dispatcher."""

    def __init__(self, *a, share: str = "all", **kw) -> None:
        super().__init__(*a, **kw)
        self.share = share

    def _route(self, tables, layer, topk_ids, topk_weights):
        batches, phys = super()._route(tables, layer, topk_ids, topk_weights)
        if self.share != "all":
            batches = [b for b in batches if self.conns[b.server].spec.kind == self.share]
        return batches, phys


def decode_ms(eng: Engine, batch: int, prompt: int, new: int, vocab: int) -> float:
    """Median milliseconds of one greedy decode step (argmax read back each step) after a
    ``prompt``-token prefill and 3 warm-up steps: a median, since a stray millisecond-scale stall
    of one of three processes on a shared host would move a mean."""
    g = torch.Generator().manual_seed(batch)
    seqs = [eng.new_seq() for _ in range(batch)]
    logits = eng.step([(s, torch.randint(0, vocab, (prompt,), generator=g).tolist()) for s in seqs])
    toks = torch.stack(logits).argmax(-1).tolist()
    times = []
    for i in range(3 + new):
        t0 = time.perf_counter()
        toks = torch.stack(eng.step([(s, [t]) for s, t in zip(seqs, toks)])).argmax(-1).tolist()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    for s in seqs:
        eng.free(s)
    return statistics.median(times) * 1e3


def configs(e: int, fractions: list[float], defers: list[int]) -> list[tuple[str, int, str, int]]:
    """(name, --num-gpu-experts, share, --cpu-defer-experts); rows of one placement together."""
    out = [("gpu_all", e, "all", 0), ("cpu_all", 0, "all", 0)]
    for f in fractions:
        g, tag = round(e * f), f"{f:.0%}"
        out += [
            (f"hybrid {tag}", g, "all", 0),
            (f"cpu_share {tag}", g, "cpu", 0),
            (f"gpu_share {tag}", g, "gpu", 0),
        ]
        out += [(f"defer{n} {tag}", g, "all", n) for n in defers]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="coordinator and GPU expert server device")
    ap.add_argument("--tiny", action="store_true", help="small widths (smoke test)")
    ap.add_argument("--cpu-threads", type=int, default=14)
    ap.add_argument("--gpu-fractions", default="0.25,0.5")
    ap.add_argument("--defer", default="2,4", help="--cpu-defer-experts values timed per fraction")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=48, help="decode steps timed (median of each step)")
    ap.add_argument("--depths", default="1,4", help="two checkpoint depths: per-layer cost = difference")
    ap.add_argument("--coordinator-threads", type=int, default=1)
    ap.add_argument(
        "--extra-cpu-threads",
        type=int,
        default=0,
        help="also time the largest GPU share at depth 2 with this many",
    )
    ap.add_argument("--work", default="/tmp/bench_hybrid_e2e")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    w = TINY if args.tiny else QWEN3_30B
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    depths = tuple(int(d) for d in args.depths.split(","))
    dirs = write_checkpoints(Path(args.work), w, depths)
    print(f"checkpoints: {time.perf_counter() - t0:.1f}s", flush=True)
    torch.set_num_threads(args.coordinator_threads)
    fractions = [float(f) for f in args.gpu_fractions.split(",")]
    rows = configs(w["experts"], fractions, [int(n) for n in args.defer.split(",") if n.strip()])
    pages = max(args.batches) * -(-(args.prompt + args.new + 8) // 16) + 8
    step_ms: dict[str, dict[int, dict[int, float]]] = {name: {} for name, *_ in rows}
    trips: dict[str, dict[int, dict[str, float]]] = {}  # round trips at the deepest checkpoint
    for depth, path in dirs.items():
        ms, tr = run_rows(args, w, path, rows, args.cpu_threads, pages)
        for name in ms:
            step_ms[name][depth] = ms[name]
        if depth == depths[-1]:
            trips = tr
    extra = {}
    if args.extra_cpu_threads:  # the largest GPU share again, the CPU server on fewer threads
        tag = f"{max(fractions):.0%}"
        names = [r for r in rows if r[0] in (f"hybrid {tag}", f"cpu_share {tag}", f"gpu_share {tag}")]
        extra, _ = run_rows(args, w, dirs[depths[-1]], names, args.extra_cpu_threads, pages)
    report(args, w, rows, step_ms, trips, fractions, out, extra)


def run_rows(args, w, path: Path, rows, cpu_threads: int, pages: int):
    """Starts both servers over ``path``; per row: ms per decode step for each batch, and the
    median round trip of each server's answers (ms)."""
    dtype, device = torch.bfloat16, torch.device(args.device)
    dt = ["--dtype", "bfloat16"]
    t0 = time.perf_counter()
    gpu = start_server("gpu", path, 0, "--device", args.device, *dt, timeout=600)
    cpu = start_server("cpu", path, 0, "--threads", str(cpu_threads), *dt, timeout=600)
    print(f"servers {path.name}, cpu threads {cpu_threads}: {time.perf_counter() - t0:.1f}s", flush=True)
    step_ms: dict[str, dict[int, float]] = {}
    trips: dict[str, dict[int, dict[str, float]]] = {}
    try:
        reader = CheckpointReader(path)
        model = load_model(reader, dtype, device)
        servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
        for name, g, share, n in rows:
            cluster = ClusterConfig(servers, num_gpu_experts=g, cpu_defer_experts=n)
            d = ShareDispatcher(reader.config, cluster, dtype, device, share=share)
            d.connect(600)
            if name == rows[0][0]:
                print("transports:", [i.get("transport") for i in d.server_infos()], flush=True)
            seen: dict[str, list[float]] = {"gpu0": [], "cpu0": []}
            d.on_round_trip = lambda server, s, seen=seen: seen[server].append(s * 1e3)
            eng = Engine(model, d, KVCacheSpec(pages, 16), dtype, device)
            step_ms[name], trips[name] = {}, {}
            for b in args.batches:
                for v in seen.values():
                    v.clear()
                step_ms[name][b] = decode_ms(eng, b, args.prompt, args.new, w["vocab"])
                trips[name][b] = {k: statistics.median(v) for k, v in seen.items() if v}
            print(name, path.name, {b: round(v, 3) for b, v in step_ms[name].items()}, flush=True)
            d.close()
            del eng
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        gpu.stop()
        cpu.stop()
    return step_ms, trips


def report(args, w, rows, step_ms, trips, fractions, out: Path, extra) -> None:
    real = w["real_depth"]
    d1, d2 = (int(d) for d in args.depths.split(","))
    res = {}
    for name, *_ in rows:
        for b in args.batches:
            lo, hi = step_ms[name][d1][b], step_ms[name][d2][b]
            per_layer = (hi - lo) / (d2 - d1)
            fixed = lo - d1 * per_layer
            res[(name, b)] = dict(
                per_layer_ms=per_layer, fixed_ms=fixed, tok_s=b / ((fixed + real * per_layer) * 1e-3),
                step_ms={str(d): step_ms[name][d][b] for d in (d1, d2)}, round_trip_ms_deepest=trips[name].get(b, {}),
            )  # fmt: skip
    for (name, b), r in res.items():
        r["vs_gpu_all"] = r["tok_s"] / res[("gpu_all", b)]["tok_s"]
        r["vs_cpu_all"] = r["tok_s"] / res[("cpu_all", b)]["tok_s"]
        for f in fractions:
            tag = f"{f:.0%}"
            if name.endswith(" " + tag) and not name.startswith(("cpu_share", "gpu_share")):
                alone = max(
                    res[(f"cpu_share {tag}", b)]["per_layer_ms"], res[(f"gpu_share {tag}", b)]["per_layer_ms"]
                )
                r["overlap_ratio"] = r["per_layer_ms"] / alone
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    threads = {}  # cpu threads -> batch -> deepest-checkpoint step ratio hybrid / max(shares)
    if extra:
        tag = f"{max(fractions):.0%}"
        for n, ms in (
            (args.cpu_threads, {k: v[d2] for k, v in step_ms.items()}),
            (args.extra_cpu_threads, extra),
        ):
            threads[n] = {b: ms[f"hybrid {tag}"][b] / max(ms[f"cpu_share {tag}"][b], ms[f"gpu_share {tag}"][b])
                          for b in args.batches}  # fmt: skip
    (out / "bench_hybrid_e2e.json").write_text(
        json.dumps(dict(widths=w, device=dev, args=vars(args), rows=[dict(mode=k[0], batch=k[1], **v) for k, v in res.items()],
                        extra_threads_step_ms=extra, l2_step_ratio_by_threads=threads), indent=1)
    )  # fmt: skip
    print(f"\n# hybrid decode, {dev}, cpu-server --threads {args.cpu_threads}, {real} layers extrapolated")
    print("| mode | batch | per-layer ms | fixed ms | tok/s | vs all-GPU | vs all-CPU | overlap ratio | round trip cpu / gpu ms (deepest) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, b), r in res.items():
        rt = r["round_trip_ms_deepest"]
        ratio = f"{r['overlap_ratio']:.2f}" if "overlap_ratio" in r else ""
        print(f"| {name} | {b} | {r['per_layer_ms']:.3f} | {r['fixed_ms']:.2f} | {r['tok_s']:.1f} | {r['vs_gpu_all']:.2f} | "
              f"{r['vs_cpu_all']:.2f} | {ratio} | {rt.get('cpu0', float('nan')):.2f} / {rt.get('gpu0', float('nan')):.2f} |")  # fmt: skip
    for n, ratios in threads.items():
        print(f"deepest step, hybrid / max(shares) at {max(fractions):.0%} on GPU, cpu-server --threads {n}: "
              + ", ".join(f"batch {b}: {r:.2f}" for b, r in ratios.items()))  # fmt: skip


if __name__ == "__main__":
    main()
