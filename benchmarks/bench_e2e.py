"""End-to-end decode speed at real model widths: expertmesh in process vs HF transformers.

Writes random-weight checkpoints of Qwen3-30B-A3B widths (bf16; H 2048, 32 query / 4 KV heads
of 128, 128 experts, top-8, expert I 768, vocab 151936) at two depths with transformers itself,
times greedy decode of ``--new`` tokens after a ``--prompt``-token prefill at each batch size,
and splits the decode step into a fixed part (embedding, final norm, lm_head, sampling, host
work) and a per-layer marginal part: ``per_layer = (t(L2) - t(L1)) / (L2 - L1)``. Tokens/s at
the real depth are ``batch / (fixed + depth * per_layer)``.

The HBM floor per layer is the bytes a decode step must read from device memory (attention and
router weights, the distinct experts the batch touches -- expected value under uniform routing
--, the KV history) over the copy bandwidth measured in the same run.

    python benchmarks/bench_e2e.py --out DIR            # on a CUDA machine
    python benchmarks/bench_e2e.py --tiny --device cpu  # smoke test of the script itself

Shapes: B batch, L layers, S context, E experts, K top-k, H hidden, I expert intermediate.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.engine import Engine  # noqa: E402
from coordinator.kv_cache import KVCacheSpec  # noqa: E402

# real_depth: decoder layers of the real model; kv_per_token: elements per token per layer a
# decode step must read from the KV history (MLA: the compressed latent, what the model needs)
QWEN3_30B = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    real_depth=48,
    kv_per_token=2 * 4 * 128,
)
# DeepSeek-V2-Lite widths; every layer MoE (the real model's layer 0 is dense) and default rope
# (the real one uses YaRN scaling, which changes no cost)
DSV2_LITE = dict(
    model_type="deepseek_v2",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    num_experts_per_tok=6,
    moe_intermediate_size=1408,
    n_shared_experts=2,
    first_k_dense_replace=0,
    topk_method="greedy",
    norm_topk_prob=False,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    real_depth=27,
    kv_per_token=512 + 64,
)
MODELS = {"qwen3-30b-a3b": QWEN3_30B, "deepseek-v2-lite": DSV2_LITE}
TINY = dict(QWEN3_30B, vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, kv_per_token=2 * 2 * 32)  # fmt: skip
BENCH_KEYS = ("model_type", "real_depth", "kv_per_token")


def write_checkpoint(
    out: Path, widths: dict, layers: int, dtype: torch.dtype, device: str, reuse: bool = False
):
    """A random checkpoint saved by transformers; returns the HF model (on ``device``).
    ``reuse``: load the one a previous run left at ``out`` instead (a before/after pair of runs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if reuse and (out / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(out, dtype=dtype, device_map=device).eval()

    fields = {k: v for k, v in widths.items() if k not in BENCH_KEYS}
    cfg = AutoConfig.for_model(
        widths["model_type"], **fields, num_hidden_layers=layers, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.save_pretrained(out)
    return model


def layer_bytes(model) -> tuple[int, int, int]:
    """(bytes of layer 0 outside the routed experts, bytes of one routed expert, routed experts)."""
    dense = routed = 0
    for name, p in model.model.layers[0].named_parameters():
        if ".experts." in name:
            routed += p.numel() * p.element_size()
        else:
            dense += p.numel() * p.element_size()
    e = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.n_routed_experts
    return dense, routed // e, e


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_decode_ms(model, batch: int, prompt: int, new: int, device: str) -> float:
    """Milliseconds per decode step of HF generate: (t(new) - t(1)) / (new - 1)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t0

    run(new)  # warm-up
    return (min(run(new) for _ in range(2)) - min(run(1) for _ in range(2))) / (new - 1) * 1e3


def em_decode_ms(eng: Engine, batch: int, prompt: int, new: int, vocab: int) -> tuple[float, list[int]]:
    """Milliseconds per decode step of expertmesh greedy decode (argmax, one host read a step)."""
    g = torch.Generator().manual_seed(batch)
    seqs = [eng.new_seq() for _ in range(batch)]
    logits = eng.step([(s, torch.randint(0, vocab, (prompt,), generator=g).tolist()) for s in seqs])
    toks = torch.stack(logits).argmax(-1).tolist()
    first = list(toks)
    for _ in range(2):  # warm-up: kernels compile for the decode shapes outside the graphs
        toks = torch.stack(eng.step([(s, [t]) for s, t in zip(seqs, toks)])).argmax(-1).tolist()
    sync(str(eng.device))
    t0 = time.perf_counter()
    for _ in range(new):
        toks = torch.stack(eng.step([(s, [t]) for s, t in zip(seqs, toks)])).argmax(-1).tolist()
    sync(str(eng.device))
    dt = (time.perf_counter() - t0) / new * 1e3
    graphs = getattr(eng, "graphs", None)
    if graphs is not None:  # the graph alone, no host work: what the GPU spends per step
        graph = graphs.graphs[graphs.bucket(batch)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        sync(str(eng.device))
        REPLAY_MS[(eng.config.num_layers, batch)] = start.elapsed_time(end) / 20
    for s in seqs:
        eng.free(s)
    return dt, first


REPLAY_MS: dict[tuple[int, int], float] = {}  # (layers, batch) -> ms per graph replay


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    if not device.startswith("cuda"):
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    sync(device)
    return 2 * a.numel() * 10 / (start.elapsed_time(end) * 1e-3)


def floor_bytes(sizes: tuple[int, int, int], w: dict, batch: int, context: int) -> float:
    """Bytes one decode step must read per layer: the layer's weights outside the routed experts,
    the distinct routed experts the batch touches (expected value under uniform routing) and
    the KV history (bf16)."""
    dense, per_expert, e = sizes
    k = w["num_experts_per_tok"]
    experts = e * (1 - (1 - k / e) ** batch) * per_expert
    return dense + experts + batch * context * w["kv_per_token"] * 2


def profile(eng: Engine, batch: int, prompt: int, vocab: int, out: Path, tag: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    seqs = [eng.new_seq() for _ in range(batch)]
    toks = torch.stack(eng.step([(s, list(range(1, prompt + 1))) for s in seqs])).argmax(-1).tolist()
    for _ in range(3):
        toks = torch.stack(eng.step([(s, [t]) for s, t in zip(seqs, toks)])).argmax(-1).tolist()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            toks = torch.stack(eng.step([(s, [t]) for s, t in zip(seqs, toks)])).argmax(-1).tolist()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    with open(out / "profiles.txt", "a") as f:
        f.write(f"\n### {tag}: 5 decode steps\n{table}\n")
    for s in seqs:
        eng.free(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b", help="the widths")
    ap.add_argument("--depths", type=int, nargs=2, default=[1, 4])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--hf-new", type=int, default=16, help="decode steps timed for HF (it is slow)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-graphs-too", action="store_true", help="also time expertmesh without CUDA graphs")
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of a few decode steps")
    ap.add_argument("--old-engine", action="store_true", help="time an Engine without cuda_graphs (before)")
    ap.add_argument("--tiny", action="store_true", help="small widths (smoke test)")
    ap.add_argument("--work", default="/tmp/bench_e2e")
    ap.add_argument(
        "--reuse", action="store_true", help="reuse the checkpoints a previous run wrote to --work"
    )
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    widths = TINY if args.tiny else MODELS[args.model]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = widths["vocab_size"]
    pages = max(args.batches) * -(-(args.prompt + args.new + 1) // 16) + 8
    res: dict[str, dict[int, dict[int, float]]] = {}  # mode -> depth -> batch -> ms per step
    modes = (
        ["expertmesh"]
        + (["expertmesh_nograph"] if args.no_graphs_too else [])
        + ([] if args.no_hf else ["hf"])
    )
    for m in modes:
        res[m] = {}
    first_tokens: dict[str, list[int]] = {}
    for depth in args.depths:
        ck = Path(args.work) / f"{widths['model_type']}_L{depth}"
        t0 = time.perf_counter()
        hf = write_checkpoint(ck, widths, depth, dtype, args.device, args.reuse)
        sizes = layer_bytes(hf)
        print(f"checkpoint L={depth}: {time.perf_counter() - t0:.1f}s", flush=True)
        if not args.no_hf:
            res["hf"][depth] = {
                b: hf_decode_ms(hf, b, args.prompt, args.hf_new, args.device) for b in args.batches
            }
            print("hf", depth, res["hf"][depth], flush=True)
        del hf
        gc.collect()
        for m in [x for x in modes if x.startswith("expertmesh")]:
            t0 = time.perf_counter()
            kw = {} if args.old_engine else {"cuda_graphs": m == "expertmesh"}
            eng = Engine.from_checkpoint(str(ck), dtype=dtype, device=args.device, num_pages=pages, **kw)
            kv_bytes = KVCacheSpec.bytes_per_page(eng.config, 1, dtype) // depth
            print(f"KV cache: {kv_bytes} bytes per token per layer", flush=True)
            if getattr(eng, "graphs", None) is not None:
                print(f"graphs captured: pool {eng.graphs.pool_bytes / 2**20:.0f} MiB", flush=True)
            print(f"engine {m} L={depth}: {time.perf_counter() - t0:.1f}s", flush=True)
            res[m][depth] = {}
            for b in args.batches:
                res[m][depth][b], first = em_decode_ms(eng, b, args.prompt, args.new, vocab)
                first_tokens[f"{m}_L{depth}_b{b}"] = first[:4]
            print(m, depth, res[m][depth], flush=True)
            if args.profile and (m == "expertmesh" or args.old_engine):
                for b in (1, max(args.batches)):
                    profile(eng, b, args.prompt, vocab, out, f"{m}_L{depth}_b{b}")
            del eng
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    bw = copy_bandwidth(args.device)
    l1, l2 = args.depths
    real = widths["real_depth"]
    rows = []
    for m in modes:
        for b in args.batches:
            per_layer = (res[m][l2][b] - res[m][l1][b]) / (l2 - l1)
            fixed = res[m][l1][b] - l1 * per_layer
            tok_s = b / ((fixed + real * per_layer) * 1e-3)
            if m == "expertmesh" and (l2, b) in REPLAY_MS:
                r1, r2 = REPLAY_MS[(l1, b)], REPLAY_MS[(l2, b)]
                print(f"graph replay alone, batch {b}: {r1:.3f} / {r2:.3f} ms at {l1} / {l2} layers: "
                      f"{(r2 - r1) / (l2 - l1):.3f} ms per layer")  # fmt: skip
            rows.append(dict(mode=m, batch=b, per_layer_ms=per_layer, fixed_ms=fixed, tok_s=tok_s,
                             step_ms={str(d): res[m][d][b] for d in args.depths}))  # fmt: skip
    ctx = args.prompt + args.new // 2
    floors = {b: floor_bytes(sizes, widths, b, ctx) / bw * 1e3 for b in args.batches}
    report = dict(model=args.model, layer_bytes=sizes, device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  torch=torch.__version__, args=vars(args), copy_bw_GBs=bw / 1e9, rows=rows,
                  floor_ms_per_layer=floors, first_tokens=first_tokens, kv_bytes_per_token_layer=kv_bytes)  # fmt: skip
    (out / "bench_e2e.json").write_text(json.dumps(report, indent=1))
    print(
        f"\n{args.model}: {report['device']}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s"
    )
    print(f"| mode | batch | per-layer ms | fixed ms | tok/s at {real} layers | HBM floor per layer ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['batch']} | {r['per_layer_ms']:.3f} | {r['fixed_ms']:.2f} | "
              f"{r['tok_s']:.0f} | {floors[r['batch']]:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
