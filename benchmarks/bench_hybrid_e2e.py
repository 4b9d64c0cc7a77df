"""End-to-end hybrid decode: coordinator on the GPU, a GPU expert server and a CPU expert server.

Random-weight Qwen3-30B-A3B widths (bf16; H 2048, 32/4 heads of 128, 128 experts, top-8, expert
I 768, vocab 151936), a checkpoint of ``--depth`` layers. Decode runs as the server runs it:
piecewise CUDA graphs between the MoE dispatches (coordinator/model/remote_graphs.py), buckets 1 and
4. The per-layer time is measured directly: the median interval between two consecutive MoE
dispatches of a step (it holds one whole layer: the segment replay, route, sends, the wait and
the sum); ``fixed`` = median step - depth x per-layer; tokens/s at the real depth (48) =
``batch / (fixed + 48 * per_layer)``. Rows, all against the same two servers:

- ``gpu_all`` / ``cpu_all``: every expert on the GPU server / on the CPU server (baselines);
- ``hybrid G%``: ``--num-gpu-experts`` = G% of the experts, the rest on the CPU server;
- ``hybrid/main-wait G%``: the same with the older wait that collected answers in send order (before/after);
- ``defer N G%``: the same with ``--cpu-defer-experts N`` (coordinator/model/deferral.py);
- ``cpu_share G%`` / ``gpu_share G%``: the hybrid placement with only the CPU (GPU) server's
  requests sent (the other share dropped: numbers wrong, time = that share alone).

The rows of one placement alternate step by step on one connection (the CPU server's speed
drifts by tens of percent over seconds on the lent host: rows timed one after the other
compared that drift, not the rows). Overlap ratio = hybrid per-layer / max(cpu_share,
gpu_share) per-layer (1.0: the two shares fully overlap; target <= 1.15). Per row the profile
gives, per layer (medians): route + send, wait (sends returned -> sum done), the rest (segment
replay + routing to the host), and per server the round trip (send -> answer collected) and
the server's own time (fast path: from reading the request to answering).

``--baseline-root DIR`` runs the same rows a second time in a child process whose coordinator
code comes from DIR (e.g. an export of main), against the same servers: before/after in one run.

    python benchmarks/bench_hybrid_e2e.py --out DIR                 # on a CUDA machine
    python benchmarks/bench_hybrid_e2e.py --tiny --device cpu       # smoke test of the script

Shapes: B batch, E experts, K top-k, H hidden, I expert intermediate, V vocab.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

# NOTE: a baseline child imports the coordinator from --baseline-root (BENCH_LIB_ROOT), not here
sys.path.insert(0, os.environ.get("BENCH_LIB_ROOT") or str(Path(__file__).resolve().parents[1]))

from coordinator.experts.remote import ClusterConfig, RemoteDispatcher, ServerSpec  # noqa: E402
from coordinator.model.deferral import DeferredSums  # noqa: E402
from coordinator.model.dispatch import Pending  # noqa: E402
from coordinator.model.engine import Engine  # noqa: E402
from coordinator.model.kv_cache import KVCacheSpec  # noqa: E402
from coordinator.model.loader import load_model  # noqa: E402
from expertmesh.checkpoint import CheckpointReader  # noqa: E402

QWEN3_30B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, inter=768,
                 vocab=151936, real_depth=48)  # fmt: skip
TINY = dict(
    hidden=128, heads=4, kv_heads=2, head_dim=32, experts=16, top_k=4, inter=64, vocab=512, real_depth=48
)
BUCKETS = (1, 4)


def _config(w: dict, depth: int) -> dict:
    return dict(
        model_type="qwen3_moe", vocab_size=w["vocab"], hidden_size=w["hidden"], intermediate_size=3 * w["hidden"],
        num_hidden_layers=depth, num_attention_heads=w["heads"], num_key_value_heads=w["kv_heads"],
        head_dim=w["head_dim"], moe_intermediate_size=w["inter"], num_experts=w["experts"],
        num_experts_per_tok=w["top_k"], norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False,
    )  # fmt: skip


def write_checkpoint(path: Path, w: dict, depth: int) -> Path:
    """Random bf16, scaled so activations stay O(1); kept when ``path`` already holds it."""
    cfg = _config(w, depth)
    if (path / "config.json").exists() and json.loads((path / "config.json").read_text()) == cfg:
        return path
    path.mkdir(parents=True, exist_ok=True)
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

    def ones() -> torch.Tensor:  # NOTE: a fresh tensor each: safetensors refuses shared storage
        return torch.ones(h, dtype=torch.bfloat16)

    save_file(
        {
            "model.embed_tokens.weight": rnd(w["vocab"], h, fan_in=1),
            "model.norm.weight": ones(),
            "lm_head.weight": rnd(w["vocab"], h, fan_in=h),
        },
        str(path / "common.safetensors"),
    )
    weight_map = {
        n: "common.safetensors" for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    }
    for layer in range(depth):
        p = f"model.layers.{layer}."
        shard = {
            p + "input_layernorm.weight": ones(),
            p + "post_attention_layernorm.weight": ones(),
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
        save_file(shard, str(path / f"layer{layer}.safetensors"))
        weight_map.update({n: f"layer{layer}.safetensors" for n in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


class ProbedDispatcher(RemoteDispatcher):
    """The remote dispatcher with a per-layer profile and per-step switches (one placement, so
    the variants of a row group can alternate step by step on one connection):

    - ``share`` (``"cpu"`` / ``"gpu"``) sends only that kind of server's requests (the share's
      time alone); ``"all"`` sends everything;
    - :meth:`set_defer` turns ``--cpu-defer-experts`` on or off (coordinator/model/deferral.py);
    - ``main_wait``: the older wait, each answer summed as it is collected
      (zeros launched right after the sends, the first answer's copy to the GPU and its add
      while the other server still computes), for a before/after in the same run.
    """

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.share, self.main_wait = "all", False
        self.events: list[tuple[float, float, float]] = []  # per layer: submit, sent, summed
        self.server_ms: dict[str, list[float]] = {}  # server -> its own time per answer
        self.trips: dict[str, list[float]] = {}  # server -> send .. collected (ms)
        self.on_round_trip = lambda server, s: self.trips.setdefault(server, []).append(s * 1e3)
        self._sent: list | None = None

    def set_defer(self, n: int) -> None:
        # NOTE: the dispatcher's own state (begin_step resets it): a benchmark-only switch
        self._deferred = DeferredSums(n) if n else None

    def _route(self, tables, layer, topk_ids, topk_weights):
        batches, phys = super()._route(tables, layer, topk_ids, topk_weights)
        if self.share != "all":
            batches = [b for b in batches if self.conns[b.server].spec.kind == self.share]
        return batches, phys

    def _send(self, tables, layer, x, batches, adapters):
        sent = super()._send(tables, layer, x, batches, adapters)
        if self._sent is None:  # the layer's immediate requests (held-back ones are sent after)
            self._sent = sent
        return sent

    def _waiter(self, tables, layer, x, ids, w, phys, adapters, sent, t0, only, out=None):
        if not self.main_wait:
            return super()._waiter(tables, layer, x, ids, w, phys, adapters, sent, t0, only, out)

        def wait() -> torch.Tensor:  # main's sum as it was (its failover branch left out)
            dst = torch.empty_like(x) if out is None else out  # [T, H]
            whole = len(sent) == 1 and sent[0][0].rows.numel() == x.shape[0]
            if not whole:
                dst.zero_()
            deadline = time.monotonic() + self.cluster.timeout_s
            for b, reply in sent:
                part = self._collect(b, reply, layer, x.shape[1], deadline)  # [T_s, H]
                self.on_round_trip(self.conns[b.server].spec.name, time.perf_counter() - t0)
                if whole:
                    dst.copy_(part)
                else:
                    part = part.to(device=x.device, dtype=x.dtype)
                    if b.rows.numel() == x.shape[0]:
                        dst.add_(part)
                    else:
                        dst.index_add_(0, b.rows.to(x.device), part)
                reply.release()
            return dst

        def abandon() -> None:
            for _, reply in sent:
                reply.abandon()

        return wait, abandon

    def submit(self, layer, *a, **kw):
        t0 = time.perf_counter()
        self._sent = None
        pending = super().submit(layer, *a, **kw)
        t1 = time.perf_counter()
        sent = self._sent

        def wait() -> torch.Tensor:
            out = pending.wait()
            self.events.append((t0, t1, time.perf_counter()))
            for b, reply in sent or ():
                inner = getattr(reply, "reply", None)  # the fast path's answer carries its time
                ms = inner.server_ms if inner is not None else getattr(reply, "compute_ms", None)
                if ms:
                    self.server_ms.setdefault(self.conns[b.server].spec.name, []).append(ms)
            return out

        return Pending(wait)

    def clear(self) -> None:
        self.events.clear()
        self.server_ms.clear()
        self.trips.clear()


def use(eng: Engine, d: RemoteDispatcher, graphs) -> None:
    """Points the engine (and its captured graphs) at dispatcher ``d``: the graphs hold no
    dispatcher state, so one capture serves every row."""
    eng.dispatcher = d
    eng.model.attach(d)
    eng.graphs = graphs if d.graph_mode == "piecewise" else None
    if eng.graphs is not None:
        eng.graphs.dispatcher = d


# a row of a group: (name, share, --cpu-defer-experts, main's wait)
Variant = tuple[str, str, int, bool]


def decode(eng: Engine, d: ProbedDispatcher, variants: list[Variant], batch: int, args, vocab: int) -> dict:
    """Greedy decode (argmax read back each step) of each variant's own ``batch`` sequences
    after a ``prompt``-token prefill and 3 warm-up steps, the variants taking turns step by step
    (rotating who goes first): a drift of the host's speed hits each alike. Per variant the
    medians of the timed steps and of their layers."""
    g = torch.Generator().manual_seed(batch)

    def switch(v: Variant) -> None:
        d.share, d.main_wait = v[1], v[3]
        d.set_defer(v[2])

    seqs, toks, stats = {}, {}, {}
    for v in variants:
        switch(v)
        seqs[v] = [eng.new_seq() for _ in range(batch)]
        logits = eng.step(
            [(s, torch.randint(0, vocab, (args.prompt,), generator=g).tolist()) for s in seqs[v]]
        )
        toks[v] = torch.stack(logits).argmax(-1).tolist()
        stats[v] = dict(steps=[], layers=[], route=[], wait=[], rest=[], trips={}, server={})
    for i in range(3 + args.new):
        k = i % len(variants)
        for v in variants[k:] + variants[:k]:
            switch(v)
            d.clear()
            t0 = time.perf_counter()
            toks[v] = torch.stack(eng.step([(s, [t]) for s, t in zip(seqs[v], toks[v])])).argmax(-1).tolist()
            if i < 3:
                continue
            st, ev = stats[v], d.events
            st["steps"].append(time.perf_counter() - t0)
            assert len(ev) == args.depth, f"{len(ev)=} {args.depth=}"
            st["layers"] += [b[0] - a[0] for a, b in zip(ev, ev[1:])]  # one whole layer each
            st["route"] += [e[1] - e[0] for e in ev]
            st["wait"] += [e[2] - e[1] for e in ev]
            st["rest"] += [b[0] - a[2] for a, b in zip(ev, ev[1:])]
            for key, src in (("trips", d.trips), ("server", d.server_ms)):
                for name, vals in src.items():
                    st[key].setdefault(name, []).extend(vals)
    for v in variants:
        for s in seqs[v]:
            eng.free(s)
    med = statistics.median
    return {
        v[0]: dict(
            step_ms=med(st["steps"]) * 1e3,
            layer_ms=med(st["layers"]) * 1e3,
            route_send_ms=med(st["route"]) * 1e3,
            wait_ms=med(st["wait"]) * 1e3,
            segment_ms=med(st["rest"]) * 1e3,
            n_layers=len(st["layers"]),
            round_trip_ms={k: med(x) for k, x in st["trips"].items() if x},
            server_ms={k: med(x) for k, x in st["server"].items() if x},
        )  # fmt: skip
        for v, st in stats.items()
    }


def groups_for(
    e: int, fractions: list[float], defers: list[int], alt_threads: int
) -> list[tuple[int, int, list[Variant]]]:
    """(--num-gpu-experts, CPU server: 0 main, 1 the one on ``alt_threads`` threads, rows): the
    rows of one group share a placement and alternate step by step."""
    out = [(e, 0, [("gpu_all", "all", 0, False)]), (0, 0, [("cpu_all", "all", 0, False)])]
    for f in fractions:
        g, tag = round(e * f), f"{f:.0%}"
        rows = [(f"hybrid {tag}", "all", 0, False), (f"hybrid/main-wait {tag}", "all", 0, True),
                (f"cpu_share {tag}", "cpu", 0, False), (f"gpu_share {tag}", "gpu", 0, False)]  # fmt: skip
        out.append((g, 0, rows + [(f"defer{n} {tag}", "all", n, False) for n in defers]))
    if alt_threads:  # the largest GPU share again, the CPU server on fewer threads
        g, tag = round(e * max(fractions)), f"{max(fractions):.0%}"
        at = f"@t{alt_threads}"
        out.append((g, 1, [(f"{k}{at} {tag}", share, 0, False) for k, share in (("hybrid", "all"), ("cpu_share", "cpu"), ("gpu_share", "gpu"))]))  # fmt: skip
    return out


def run_rows(args, w, path: Path, groups, gpu_address: str, cpu_addresses: list[str]) -> dict:
    """Every group, ``args.repeat`` passes; per row and batch the profile of each pass."""
    dtype, device = torch.bfloat16, torch.device(args.device)
    torch.set_num_threads(args.coordinator_threads)
    reader = CheckpointReader(path)
    model = load_model(reader, dtype, device)
    most = max(len(rows) for *_, rows in groups)
    pages = most * max(args.batches) * -(-(args.prompt + args.new + 8) // 16) + 8
    eng = graphs = None
    res: dict[str, dict[int, list[dict]]] = {
        v[0]: {b: [] for b in args.batches} for *_, rows in groups for v in rows
    }
    for rep in range(args.repeat):
        for g, c, rows in groups:
            servers = (ServerSpec("gpu0", gpu_address, "gpu"), ServerSpec("cpu0", cpu_addresses[c], "cpu"))
            d = ProbedDispatcher(reader.config, ClusterConfig(servers, num_gpu_experts=g), dtype, device)
            d.connect(600)
            if eng is None:
                print("transports:", [i.get("transport") for i in d.server_infos()], flush=True)
                eng = Engine(model, d, KVCacheSpec(pages, 16), dtype, device, cuda_graphs=False)
                if device.type == "cuda":
                    from coordinator.model.remote_graphs import RemoteDecodeGraphs

                    graphs = RemoteDecodeGraphs(model, eng.cache, pages, None, d, buckets=BUCKETS)
            use(eng, d, graphs)
            for b in args.batches:
                for name, r in decode(eng, d, rows, b, args, w["vocab"]).items():
                    res[name][b].append(r)
            for name, *_ in rows:
                print(rep, name, {b: round(v[-1]["layer_ms"], 3) for b, v in res[name].items()},
                      "graphs" if eng.graphs is not None else "eager", flush=True)  # fmt: skip
            d.close()
    return res


def start_servers(args, path: Path):
    from tests.cluster_utils import start_server

    t0 = time.perf_counter()
    dt = ["--dtype", "bfloat16"]
    gpu = start_server("gpu", path, 0, "--device", args.device, *dt, timeout=600)
    cpus = [start_server("cpu", path, 0, "--threads", str(args.cpu_threads), *dt, timeout=600)]
    if args.alt_cpu_threads:  # NOTE: idle between its rows: its waiters stop spinning within ms
        cpus.append(start_server("cpu", path, 0, "--threads", str(args.alt_cpu_threads), *dt, timeout=600))
    print(f"servers up: {time.perf_counter() - t0:.1f}s", flush=True)
    return gpu, cpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="coordinator and GPU expert server device")
    ap.add_argument("--tiny", action="store_true", help="small widths (smoke test)")
    ap.add_argument("--cpu-threads", type=int, default=14)
    ap.add_argument("--gpu-fractions", default="0.25,0.5")
    ap.add_argument("--defer", default="2,4", help="--cpu-defer-experts values timed per fraction")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=40, help="decode steps timed per row and pass")
    ap.add_argument("--depth", type=int, default=3, help="layers in the checkpoint (>= 2)")
    ap.add_argument("--repeat", type=int, default=2, help="passes over the rows")
    ap.add_argument("--coordinator-threads", type=int, default=1)
    ap.add_argument(
        "--alt-cpu-threads",
        type=int,
        default=0,
        help="also time the largest GPU share with a CPU server on this many threads",
    )
    ap.add_argument("--baseline-root", default="", help="also run the rows with the coordinator code of DIR")
    ap.add_argument("--connect", default="", help=argparse.SUPPRESS)  # child: GPU,CPU server addresses
    ap.add_argument("--work", default="/tmp/bench_hybrid_e2e")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    assert args.depth >= 2 and max(args.batches) <= BUCKETS[-1], args
    w = TINY if args.tiny else QWEN3_30B
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fractions = [float(f) for f in args.gpu_fractions.split(",")]
    defers = [int(n) for n in args.defer.split(",") if n.strip()]
    groups = groups_for(w["experts"], fractions, defers, args.alt_cpu_threads)
    names = [v[0] for *_, rows in groups for v in rows]
    t0 = time.perf_counter()
    path = write_checkpoint(
        Path(args.work) / f"{'tiny' if args.tiny else 'qwen3'}_L{args.depth}", w, args.depth
    )
    if args.connect:  # the baseline child: the parent's servers, its rows, results to --out
        gpu_address, *cpu_addresses = args.connect.split(",")
        res = run_rows(args, w, path, groups, gpu_address, cpu_addresses)
        (out / "baseline_rows.json").write_text(
            json.dumps({k: {str(b): v for b, v in r.items()} for k, r in res.items()})
        )
        return
    print(f"checkpoint: {time.perf_counter() - t0:.1f}s", flush=True)
    gpu, cpus = start_servers(args, path)
    base: dict = {}
    try:
        res = run_rows(args, w, path, groups, gpu.address, [c.address for c in cpus])
        if args.baseline_root:
            addresses = ",".join(s.address for s in (gpu, *cpus))
            cmd = [sys.executable, __file__, *sys.argv[1:], "--connect", addresses]
            env = dict(os.environ, BENCH_LIB_ROOT=str(Path(args.baseline_root).resolve()))
            env["PYTHONPATH"] = os.pathsep.join([env["BENCH_LIB_ROOT"], *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(__file__).resolve().parents[1]]])  # fmt: skip
            print("baseline:", env["BENCH_LIB_ROOT"], flush=True)
            subprocess.run(cmd, env=env, check=True)
            raw = json.loads((out / "baseline_rows.json").read_text())
            base = {k: {int(b): v for b, v in r.items()} for k, r in raw.items()}
    finally:
        for srv in (gpu, *cpus):
            srv.stop()
    report(args, w, names, res, base, fractions, out)


def summarise(args, w, names, res, fractions) -> dict:
    """Per (row, batch): the profile pooled over passes (median of the pass medians for the
    times), tokens/s at the real depth, ratios and the overlap ratio per pass."""
    med = statistics.median
    real = w["real_depth"]
    table = {}
    for name in names:
        for b in args.batches:
            passes = res[name][b]
            layer, step = med(p["layer_ms"] for p in passes), med(p["step_ms"] for p in passes)
            fixed = step - args.depth * layer
            table[(name, b)] = dict(
                layer_ms=layer, fixed_ms=fixed, tok_s=b / ((fixed + real * layer) * 1e-3), passes=passes,
                **{k: med(p[k] for p in passes) for k in ("route_send_ms", "wait_ms", "segment_ms")},
            )  # fmt: skip
    for (name, b), r in table.items():
        r["vs_gpu_all"] = r["tok_s"] / table[("gpu_all", b)]["tok_s"]
        r["vs_cpu_all"] = r["tok_s"] / table[("cpu_all", b)]["tok_s"]
        if " " in name and not name.startswith(("cpu_share", "gpu_share")):
            kind, tag = name.split(" ")
            at = kind[kind.index("@") :] if "@" in kind else ""  # the alternative CPU server's rows
            cs, gs = table[(f"cpu_share{at} {tag}", b)], table[(f"gpu_share{at} {tag}", b)]
            r["overlap_ratio"] = r["layer_ms"] / max(cs["layer_ms"], gs["layer_ms"])
            r["overlap_by_pass"] = [
                p["layer_ms"] / max(c["layer_ms"], g["layer_ms"])
                for p, c, g in zip(r["passes"], cs["passes"], gs["passes"])
            ]
    return table


def report(args, w, names, res, base, fractions, out: Path) -> None:
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    table = summarise(args, w, names, res, fractions)
    btable = summarise(args, w, names, base, fractions) if base else {}
    js = dict(widths=w, device=dev, cpu_count=os.cpu_count(), args=vars(args),
              rows=[dict(mode=k[0], batch=k[1], **v) for k, v in table.items()],
              baseline_rows=[dict(mode=k[0], batch=k[1], **v) for k, v in btable.items()])  # fmt: skip
    (out / "bench_hybrid_e2e.json").write_text(json.dumps(js, indent=1))
    print(f"\n# hybrid decode, {dev}, cpu-server --threads {args.cpu_threads}, depth {args.depth}, "
          f"{w['real_depth']} layers extrapolated, {args.repeat} passes")  # fmt: skip
    for title, t in (("this branch", table), ("baseline " + args.baseline_root, btable)):
        if not t:
            continue
        print(f"\n## {title}\n")
        print("| mode | batch | per-layer ms | fixed ms | tok/s | vs all-GPU | vs all-CPU | overlap ratio (per pass) "
              "| route+send / wait / segment ms | round trip cpu / gpu ms | server cpu / gpu ms |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for (name, b), r in t.items():
            ratio = ""
            if "overlap_ratio" in r:
                ratio = f"{r['overlap_ratio']:.2f} ({', '.join(f'{x:.2f}' for x in r['overlap_by_pass'])})"
            p = r["passes"][-1]
            rt, sv = p["round_trip_ms"], p["server_ms"]
            print(f"| {name} | {b} | {r['layer_ms']:.3f} | {r['fixed_ms']:.2f} | {r['tok_s']:.1f} | "
                  f"{r['vs_gpu_all']:.2f} | {r['vs_cpu_all']:.2f} | {ratio} | {r['route_send_ms']:.3f} / "
                  f"{r['wait_ms']:.3f} / {r['segment_ms']:.3f} | {rt.get('cpu0', float('nan')):.2f} / "
                  f"{rt.get('gpu0', float('nan')):.2f} | {sv.get('cpu0', float('nan')):.2f} / "
                  f"{sv.get('gpu0', float('nan')):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
