"""End-to-end decode speed at real model widths: expertmesh in process, with a GPU expert
server (same GPU over each transport, and a second GPU when there is one), vs HF transformers.

Writes random-weight checkpoints of Qwen3-30B-A3B widths (bf16; H 2048, 32 query / 4 KV heads
of 128, 128 experts, top-8, expert I 768, vocab 151936) at two depths with transformers itself,
times greedy decode of ``--new`` tokens after a ``--prompt``-token prefill at each batch size,
and splits the decode step into a fixed part (embedding, final norm, lm_head, sampling, host
work) and a per-layer marginal part: ``per_layer = (t(L2) - t(L1)) / (L2 - L1)``. Tokens/s at
the real depth are ``batch / (fixed + depth * per_layer)``.

The HBM floor per layer is the bytes a decode step must read from device memory (attention and
router weights, the distinct experts the batch touches -- expected value under uniform routing
--, the KV history) over the copy bandwidth measured in the same run.

Remote modes (``--remote``): ``expertmesh gpu-server --device cuda:G`` in its own process per
depth, the coordinator's engine in this process with a :class:`RemoteDispatcher` per transport
(piecewise decode graphs, coordinator/model/remote_graphs.py). Their floor is the two-process floor:
the in-process layer plus one same-GPU context-switch round trip
(benchmarks/bench_gpu_context_switch.py, measured in the same run).

    python benchmarks/bench_e2e.py --out DIR            # on a CUDA machine
    python benchmarks/bench_e2e.py --tiny --device cpu  # smoke test of the script itself

Shapes: B batch, L layers, S context, E experts, K top-k, H hidden, I expert intermediate.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.model.engine import Engine  # noqa: E402
from coordinator.model.kv_cache import KVCacheSpec  # noqa: E402
from expertmesh.transport.delay_proxy import DelayProxy  # noqa: E402
from expertmesh.transport.tcp import split_address  # noqa: E402

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


def em_decode_ms(
    eng: Engine, batch: int, prompt: int, new: int, vocab: int
) -> tuple[float, list[int], list[float] | None]:
    """Milliseconds per decode step of expertmesh greedy decode (argmax, one host read a step),
    the first sequence's greedy tokens, and for the remote graphs the median microseconds per
    layer of (segment replay + routing on the host, route + send, wait + copy-in, route, send,
    the server's own time)."""
    g = torch.Generator().manual_seed(batch)
    seqs = [eng.new_seq() for _ in range(batch)]
    logits = eng.step([(s, torch.randint(0, vocab, (prompt,), generator=g).tolist()) for s in seqs])
    toks = torch.stack(logits).argmax(-1).tolist()
    first = [toks[0]]
    for _ in range(2):  # warm-up: kernels compile for the decode shapes outside the graphs
        toks = torch.stack(eng.step([(s, [t]) for s, t in zip(seqs, toks)])).argmax(-1).tolist()
        first.append(toks[0])
    sync(str(eng.device))
    graphs = getattr(eng, "graphs", None)
    timings = getattr(graphs, "timings", None)
    probe = getattr(eng.dispatcher, "probe", None)
    if timings is not None:
        timings.clear()
    if probe is not None:
        probe.clear()
    t0 = time.perf_counter()
    for _ in range(new):
        toks = torch.stack(eng.step([(s, [t]) for s, t in zip(seqs, toks)])).argmax(-1).tolist()
        first.append(toks[0])
    sync(str(eng.device))
    dt = (time.perf_counter() - t0) / new * 1e3
    pieces = None
    if timings:  # host timers around the remote path's per-layer pieces (remote_graphs.py)
        pieces = [statistics.median(c) * 1e6 for c in zip(*timings)]
        if probe:  # route / send / the server's own time, inside the dispatcher
            pieces += [statistics.median(c) * 1e6 for c in zip(*probe)]
    if graphs is not None and hasattr(graphs, "graphs") and graphs.graphs:
        # the graph alone, no host work: what the GPU spends per step
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
    return dt, first, pieces


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


_LISTEN = re.compile(r"listening on (\S+):(\d+)")
_DATA = re.compile(r"TCP data path on (\S+)")


def start_gpu_server(
    ck: Path, key: ServerKey, log: Path, cpu_threads: int = 2
) -> tuple[subprocess.Popen, str, str]:
    """``expertmesh gpu-server`` on ``cuda:gpu`` (``gpu`` -1: ``expertmesh cpu-server`` with
    ``cpu_threads`` kernel threads) in its own process (key: GPU, CUDA graphs, fast-path spin in
    us or None for the default); returns it, its address and its TCP data path's address."""
    gpu, graphs, spin, pin, link = key
    kind = ["cpu-server"] if gpu < 0 else ["gpu-server", "--device", f"cuda:{gpu}"]
    threads = cpu_threads if gpu < 0 else 2
    cmd = (["taskset", "-c", _cpus(SERVER_HALF)] if pin else []) + [sys.executable, "-m", "expertmesh.cli", *kind,
           "--model", str(ck), "--port", "0", "--dtype", "bfloat16", "--threads", str(threads)]  # fmt: skip
    if not graphs and gpu >= 0:
        cmd.append("--no-cuda-graphs")
    if spin is not None:
        cmd += ["--shm-spin-us", str(spin)]
    root = str(Path(__file__).resolve().parents[1])
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    )
    if link:  # the server's own link mode (it refuses one on a shared GPU unless forced)
        env["EXPERTMESH_LINK"] = {"off": "0"}.get(link, link)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root
    )
    assert proc.stdout is not None
    f = open(log, "a")  # noqa: SIM115 (kept open by the drain thread)
    data = ""
    for line in proc.stdout:
        f.write(line)
        d = _DATA.search(line)
        if d:
            data = d.group(1)
        m = _LISTEN.search(line)
        if m:
            threading.Thread(target=lambda: [f.write(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, f"127.0.0.1:{m.group(2)}", data
    raise RuntimeError(f"{' '.join(kind)} did not start (log: {log})")


def remote_engine(
    ck: Path,
    address: str,
    transport: str,
    dtype: torch.dtype,
    pages: int,
    graphs: bool,
    spin: float | None,
    link: str = "",
    data_address: str = "",
    kind: str = "gpu",
):
    """A CUDA coordinator engine whose experts all live on the server at ``address``; ``link``:
    the device link mode (coordinator/experts/cluster_config.py LINK_MODES; "" = EXPERTMESH_LINK's);
    ``data_address``: where to reach its TCP data path (the latency proxy), "" = where it says."""
    from coordinator.experts.remote import ClusterConfig, RemoteDispatcher, ServerSpec
    from coordinator.model.loader import load_model
    from expertmesh.checkpoint import CheckpointReader

    reader = CheckpointReader(str(ck))
    kw: dict = {} if spin is None else {"shm_spin_us": spin}
    if link:
        kw["device_link"] = link
    spec = ServerSpec(f"{kind}0", address, kind, data_address=data_address)
    cluster = ClusterConfig((spec,), transport=transport, timeout_s=120, **kw)
    d = RemoteDispatcher(reader.config, cluster, dtype, "cuda")
    d.connect(300)
    dev = torch.device("cuda")
    model = load_model(reader, dtype, dev)
    eng = Engine(model, d, KVCacheSpec(pages, 16), dtype, dev, cuda_graphs=graphs)
    if eng.graphs is not None and hasattr(eng.graphs, "timings"):
        eng.graphs.timings = []  # per-layer host timers (remote_graphs.py)
        d.probe = []  # and inside the dispatcher (route / send / the server's own time)
    return eng, d


class ServerKey(NamedTuple):
    gpu: int  # -1: a CPU expert server
    graphs: bool  # the server's CUDA graphs
    spin: float | None  # both sides' fast-path spin in us (None: their defaults)
    pin: bool  # server and coordinator on disjoint halves of the cores
    link: str = ""  # EXPERTMESH_LINK of both sides ("" = this process's)


def _halves() -> tuple[list[int], list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :]


COORD_HALF, SERVER_HALF = _halves() if hasattr(os, "sched_getaffinity") else ([], [])


def _cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def remote_modes(args) -> list[tuple[str, ServerKey, str, bool, str, float, int | None]]:
    """(name, (server GPU, server graphs, spin us, ...), transport, coordinator graphs, the
    coordinator's device link mode, added one-way delay in us, micro-batches) of each remote
    mode; spin None =
    the defaults of both sides, link "" = EXPERTMESH_LINK's; a delay goes through the loopback
    latency proxy (tcp modes only: the proxy sits in front of the server's data port)."""
    out = [(f"gpu-server same GPU {t}", ServerKey(0, True, None, False), t, True) for t in args.remote]
    if args.remote_eager and args.remote:
        t = args.remote[-1]
        out.append(
            (
                f"gpu-server same GPU {t} (coordinator without graphs)",
                ServerKey(0, True, None, False),
                t,
                False,
            )
        )
        out.append(
            (f"gpu-server same GPU {t} (server without graphs)", ServerKey(0, False, None, False), t, True)
        )
    two = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    if two:
        out += [
            (f"gpu-server second GPU {t}", ServerKey(1, True, None, False), t, True) for t in args.second_gpu
        ]
    if args.spin_us_too and args.remote:  # both sides polling longer than a same-GPU layer takes
        u = args.spin_us_too
        out.append(
            (
                f"gpu-server same GPU {args.remote[-1]} (spin {u:g} us)",
                ServerKey(0, True, u, False),
                args.remote[-1],
                True,
            )
        )
        if two and args.second_gpu:
            t = args.second_gpu[0]
            out.append((f"gpu-server second GPU {t} (spin {u:g} us)", ServerKey(1, True, u, False), t, True))
    if (
        args.pin_too and args.remote and len(SERVER_HALF) >= 2 and shutil.which("taskset")
    ):  # no waking the other on one's own core
        t = args.remote[-1]
        out.append((f"gpu-server same GPU {t} (disjoint cores)", ServerKey(0, True, None, True), t, True))
        if two and args.second_gpu:
            t = args.second_gpu[0]
            out.append(
                (f"gpu-server second GPU {t} (disjoint cores)", ServerKey(1, True, None, True), t, True)
            )
    # --- the device link: rows without it (EXPERTMESH_LINK=0 on the coordinator, the
    # same server), and same GPU forced (both sides: a server of its own) ---
    modes = [(name, key, t, graphs, "") for name, key, t, graphs in out]
    if args.no_link_too:
        for name, key, t, graphs, _ in list(modes):
            if graphs and not key.pin and key.spin is None and t in ("auto", "cuda_ipc", "tcp"):
                modes.append((f"{name} (EXPERTMESH_LINK=0)", key, t, graphs, "off"))
    if args.link_force_same and args.remote:
        t = args.remote[-1]
        key = ServerKey(0, True, None, False, "force")
        modes.append((f"gpu-server same GPU {t} (EXPERTMESH_LINK=force)", key, t, True, "force"))
    modes += [
        (f"cpu-server {t}", ServerKey(-1, False, None, False), t, True, "") for t in args.cpu_server_too
    ]
    if args.no_link_too:  # the host link (shm) or the relayed one (tcp) off
        modes += [
            (f"cpu-server {t} (EXPERTMESH_LINK=0)", ServerKey(-1, False, None, False), t, True, "off")
            for t in args.cpu_server_too
            if t in ("shm", "tcp", "auto")
        ]
    # micro-batches None: the coordinator's default (auto: split where it paid)
    timed: list[tuple[str, ServerKey, str, bool, str, float, int | None]] = [(*m, 0.0, None) for m in modes]
    if args.delay_us:  # the tcp modes again, a proxy's delay away
        u = args.delay_us
        timed += [(f"{m[0]} (+{u:g} us each way)", *m[1:], u, None) for m in modes if m[2] == "tcp"]
    if args.micro_batches > 1:  # and again with micro-batched decode (eager: no decode graphs)
        n = args.micro_batches
        timed += [(f"{m[0]} ({n} micro-batches)", *m[1:6], n) for m in list(timed) if m[2] == "tcp"]
    return timed


def _demo_server(ck: Path) -> tuple[subprocess.Popen, str, str]:
    """A ``cpu-server`` (one torch thread) of the demo model: (process, address, data address)."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=root)
    cmd = [
        sys.executable,
        "-m",
        "expertmesh.cli",
        "cpu-server",
        "--model",
        str(ck),
        "--port",
        "0",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root
    )
    assert proc.stdout is not None
    data = ""
    for line in proc.stdout:
        if d := _DATA.search(line):
            data = d.group(1)
        if m := _LISTEN.search(line):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, f"127.0.0.1:{m.group(2)}", data
    raise RuntimeError("cpu-server did not start")


def demo_cpu(args) -> None:
    """``--demo-cpu T...``: the demo model on this machine's CPU, a ``cpu-server`` process
    holding every expert and the coordinator's engine in this process, one engine per transport
    (each with its own stream to and server of its own), all timed in one run, batches
    interleaved. Prints decode tokens/s and the per-layer split, medians (send: the coordinator's
    route + encode + send; server: the server's own time per layer; then from the send's end to
    the answer summed: the wire, both wake-ups, the shared expert, the answer's decode). Where
    cores are few the server runs inside the coordinator's send (the socket write wakes it), so
    its time overlaps "send" as much as the last column."""
    from coordinator.experts.remote import ClusterConfig, RemoteDispatcher, ServerSpec
    from coordinator.model.loader import load_model
    from expertmesh.checkpoint import CheckpointReader
    from expertmesh.demo import write_demo_model

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ck = write_demo_model(Path(args.work) / "demo-model")
    reader = CheckpointReader(str(ck))
    cfg = reader.config
    vocab = cfg.vocab_size
    pages = max(args.batches) * -(-(args.prompt + args.new + 3 + 1) // 16) + 8
    modes: list[tuple[str, str, float, int | None]] = [(t, t, 0.0, None) for t in args.demo_cpu]
    if args.delay_us and "tcp" in args.demo_cpu:
        modes.append((f"tcp (+{args.delay_us:g} us each way)", "tcp", args.delay_us, None))
    if args.micro_batches > 1:  # the tcp modes again, decode steps split into micro-batches
        n = args.micro_batches
        modes += [(f"{m[0]}, {n} micro-batches", m[1], m[2], n) for m in list(modes) if m[1] == "tcp"]
    proxies: list[DelayProxy] = []
    procs: list[subprocess.Popen] = []
    engines = {}
    try:
        ref = Engine.from_checkpoint(str(ck), num_pages=pages)
        for name, transport, delay, micro in modes:
            # NOTE: a server each: every coordinator pushes its own placement generation
            proc, address, data = _demo_server(ck)
            procs.append(proc)
            data_address = ""
            if delay:
                proxies.append(DelayProxy(split_address(data), delay_us=delay))
                data_address = proxies[-1].address
            spec = ServerSpec("cpu0", address, "cpu", data_address=data_address)
            d = RemoteDispatcher(
                cfg, ClusterConfig((spec,), transport=transport, timeout_s=60), torch.float32
            )
            d.connect(120)
            d.probe = []
            eng = Engine(load_model(reader, torch.float32, torch.device("cpu")), d, KVCacheSpec(pages, 16),
                         torch.float32, torch.device("cpu"))  # fmt: skip
            eng.micro_batches = micro
            engines[name] = (eng, d, d.server_infos()[0]["transport"])
        best: dict[tuple[str, int], float] = {}
        split: dict[tuple[str, int], list[float]] = {}
        same: dict[tuple[str, int], bool] = {}
        for b in args.batches:
            _, want, _ = em_decode_ms(ref, b, args.prompt, args.new, vocab)
            for _ in range(args.rounds):
                for name, (eng, d, _) in engines.items():
                    ms, first, _ = em_decode_ms(eng, b, args.prompt, args.new, vocab)
                    if ms < best.get((name, b), float("inf")):
                        best[name, b] = ms
                        assert d.probe is not None
                        cols = [statistics.median(c) * 1e6 for c in zip(*d.probe)]  # route, send, server, rt
                        split[name, b] = [cols[0] + cols[1], cols[2], cols[3]]
                    same[name, b] = first == want
            print(b, {n: f"{best[n, b]:.2f} ms" for n in engines}, flush=True)
    finally:
        for _, d, _ in engines.values():
            d.close()
        for p in proxies:
            p.close()
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    layers = len(cfg.moe_layer_ids)
    print(f"\ndemo model ({cfg.num_layers} layers, {layers} MoE, H {cfg.hidden_size}), cpu-server, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.new} decode steps after a {args.prompt}-token prompt, best of {args.rounds}")  # fmt: skip
    print(
        "| transport (negotiated) | batch | ms per step | tok/s | vs grpc | per layer us: send / server / send's end to answer | greedy tokens = in process |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for b in args.batches:
        for name, (_, _, negotiated) in engines.items():
            ms = best[name, b]
            base = best.get(("grpc", b))
            ratio = f"{base / ms:.2f}x" if base else ""
            sp = " / ".join(f"{x:.0f}" for x in split[name, b])
            print(
                f"| {name} ({negotiated}) | {b} | {ms:.2f} | {b / ms * 1e3:.0f} | {ratio} | {sp} | {same[name, b]} |"
            )
            rows.append(dict(mode=name, transport=negotiated, batch=b, ms=ms, tok_s=b / ms * 1e3,
                             split_us=split[name, b], same_tokens=same[name, b]))  # fmt: skip
    (out / "bench_e2e_demo_cpu.json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))


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
    ap.add_argument("--remote", nargs="*", default=[], metavar="TRANSPORT",
                    help="GPU expert server on this GPU over each transport (grpc shm cuda_ipc auto)")  # fmt: skip
    ap.add_argument("--second-gpu", nargs="*", default=["auto", "grpc"], metavar="TRANSPORT",
                    help="transports to a GPU expert server on a second GPU (when there is one)")  # fmt: skip
    ap.add_argument(
        "--remote-eager", action="store_true", help="also the last --remote transport without graphs"
    )
    ap.add_argument("--pin-too", action="store_true",
                    help="also the last --remote / first --second-gpu transport with server and coordinator on disjoint cores")  # fmt: skip
    ap.add_argument("--spin-us-too", type=float, default=0.0, metavar="U",
                    help="also the last --remote / first --second-gpu transport with both sides spinning U us")  # fmt: skip
    ap.add_argument("--cpu-server-too", nargs="*", default=[], metavar="TRANSPORT",
                    help="also a CPU expert server holding every expert over each transport (e.g. tcp grpc)")  # fmt: skip
    ap.add_argument("--cpu-threads", type=int, default=max(2, (os.cpu_count() or 2) - 4), metavar="N",
                    help="the CPU expert server's kernel threads (default: cores - 4)")  # fmt: skip
    ap.add_argument("--delay-us", type=float, default=0.0, metavar="U",
                    help="also each tcp mode through the loopback latency proxy adding U us each way")  # fmt: skip
    ap.add_argument("--no-link-too", action="store_true",
                    help="also each remote mode with the device link off (EXPERTMESH_LINK=0)")  # fmt: skip
    ap.add_argument("--link-force-same", action="store_true",
                    help="also the last --remote transport with the link forced on the same GPU (a check; it time-slices)")  # fmt: skip
    ap.add_argument(
        "--switch-rounds", type=int, default=400, help="rounds of the context-switch floor (0 = skip)"
    )
    ap.add_argument("--tiny", action="store_true", help="small widths (smoke test)")
    ap.add_argument("--work", default="/tmp/bench_e2e")
    ap.add_argument(
        "--reuse", action="store_true", help="reuse the checkpoints a previous run wrote to --work"
    )
    ap.add_argument("--out", default=".")
    ap.add_argument("--demo-cpu", nargs="*", default=None, metavar="TRANSPORT",
                    help="instead: the demo model on the CPU against a cpu-server over each transport (grpc tcp)")  # fmt: skip
    ap.add_argument(
        "--rounds", type=int, default=3, help="--demo-cpu: timed rounds per mode and batch (best kept)"
    )
    ap.add_argument("--micro-batches", type=int, default=1, metavar="N",
                    help="also each tcp mode with decode steps split into N micro-batches "
                         "(the other rows take the coordinator's default, auto)")  # fmt: skip
    args = ap.parse_args()
    if args.demo_cpu is not None:
        return demo_cpu(args)
    widths = TINY if args.tiny else MODELS[args.model]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = widths["vocab_size"]
    pages = max(args.batches) * -(-(args.prompt + args.new + 3 + 1) // 16) + 8
    res: dict[str, dict[int, dict[int, float]]] = {}  # mode -> depth -> batch -> ms per step
    remotes = remote_modes(args) if args.device.startswith("cuda") else []
    modes = (
        ["expertmesh"]
        + (["expertmesh_nograph"] if args.no_graphs_too else [])
        + [r[0] for r in remotes]
        + ([] if args.no_hf else ["hf"])
    )
    for m in modes:
        res[m] = {}
    first_tokens: dict[str, list[int]] = {}
    pieces: dict[str, dict[int, dict[int, list[float]]]] = {}  # remote mode -> depth -> batch -> us
    transports: dict[str, str] = {}
    linked: dict[str, tuple[int, int]] = {}  # remote mode -> (linked steps, re-runs) at the last depth
    failed: dict[str, str] = {}
    for depth in args.depths:
        ck = Path(args.work) / f"{widths['model_type']}_L{depth}"
        t0 = time.perf_counter()
        hf = write_checkpoint(ck, widths, depth, dtype, args.device, args.reuse)
        sizes = layer_bytes(hf)
        print(f"checkpoint L={depth}: {time.perf_counter() - t0:.1f}s", flush=True)
        proxies: list[DelayProxy] = []
        servers = {  # they load while the in-process modes are timed
            key: start_gpu_server(
                ck, key, out / f"gpu_server{'_'.join(map(str, key))}_L{depth}.log", args.cpu_threads
            )
            for key in sorted({r[1] for r in remotes}, key=str)
        }
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
                res[m][depth][b], first, _ = em_decode_ms(eng, b, args.prompt, args.new, vocab)
                first_tokens[f"{m}_L{depth}_b{b}"] = first
            print(m, depth, res[m][depth], flush=True)
            if args.profile and (m == "expertmesh" or args.old_engine):
                for b in (1, max(args.batches)):
                    profile(eng, b, args.prompt, vocab, out, f"{m}_L{depth}_b{b}")
            del eng
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        try:
            for name, key, transport, graphs, link, delay, micro in remotes:
                t0 = time.perf_counter()
                try:
                    # this thread (the one that waits) and the threads it starts
                    os.sched_setaffinity(0, COORD_HALF if key.pin else COORD_HALF + SERVER_HALF)
                    data = ""
                    if delay:
                        proxy = DelayProxy(split_address(servers[key][2]), delay_us=delay)
                        proxies.append(proxy)
                        data = proxy.address
                    kind = "cpu" if key.gpu < 0 else "gpu"
                    eng, d = remote_engine(
                        ck, servers[key][1], transport, dtype, pages, graphs, key.spin, link, data, kind
                    )
                except Exception as e:  # noqa: BLE001  # NOTE: a mode that cannot start is reported, the others run
                    print(f"MODE FAILED {name} L={depth}: {type(e).__name__}: {e}", flush=True)
                    failed[name] = f"{type(e).__name__}: {e}"
                    continue
                eng.micro_batches = micro
                transports[name] = d.server_infos()[0]["transport"]
                if d.conns[0].link() is not None:
                    transports[name] += "+link"
                print(
                    f"engine {name} L={depth} ({transports[name]}): {time.perf_counter() - t0:.1f}s",
                    flush=True,
                )
                try:
                    res[name][depth], pieces.setdefault(name, {})[depth] = {}, {}
                    for b in args.batches:
                        res[name][depth][b], first, us = em_decode_ms(eng, b, args.prompt, args.new, vocab)
                        first_tokens[f"{name}_L{depth}_b{b}"] = first
                        if us is not None:
                            pieces[name][depth][b] = us
                    print(name, depth, res[name][depth], pieces[name][depth], flush=True)
                    linked[name] = (d.linked_steps, d.link_reruns)
                    if d.linked_steps:
                        print(
                            f"linked graphs of {name}: pool {eng.graphs.link_pool_bytes / 2**20:.0f} MiB",
                            flush=True,
                        )  # type: ignore[union-attr]
                    if (
                        args.profile
                        and graphs
                        and key == ServerKey(0, True, None, False)
                        and transport == args.remote[-1]
                    ):
                        profile(eng, 1, args.prompt, vocab, out, f"{name}_L{depth}_b1")
                except Exception as e:  # noqa: BLE001  # NOTE: reported; the other modes still run
                    print(f"MODE FAILED {name} L={depth}: {type(e).__name__}: {e}", flush=True)
                    failed[name] = f"{type(e).__name__}: {e}"
                    res[name].pop(depth, None)
                finally:
                    d.close()
                    del eng, d
                    gc.collect()
                    torch.cuda.empty_cache()
                    os.sched_setaffinity(0, COORD_HALF + SERVER_HALF)
        finally:
            for p in proxies:
                p.close()
            for proc, _, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    bw = copy_bandwidth(args.device)
    switch = {}
    if args.device.startswith("cuda") and args.switch_rounds:
        from bench_gpu_context_switch import measure  # beside this script (sys.path[0])

        switch = measure(args.switch_rounds, ("none", "kernel"))
        print(f"same-GPU context switch round trip: {switch}", flush=True)
    l1, l2 = args.depths
    real = widths["real_depth"]
    rows = []
    for m in modes:
        if any(d not in res[m] for d in args.depths):
            print(f"no rows for {m}: {failed.get(m, 'not run at both depths')}")
            continue
        for b in args.batches:
            per_layer = (res[m][l2][b] - res[m][l1][b]) / (l2 - l1)
            fixed = res[m][l1][b] - l1 * per_layer
            tok_s = b / ((fixed + real * per_layer) * 1e-3)
            if m == "expertmesh" and (l2, b) in REPLAY_MS:
                r1, r2 = REPLAY_MS[(l1, b)], REPLAY_MS[(l2, b)]
                print(f"graph replay alone, batch {b}: {r1:.3f} / {r2:.3f} ms at {l1} / {l2} layers: "
                      f"{(r2 - r1) / (l2 - l1):.3f} ms per layer")  # fmt: skip
            ref = first_tokens.get(f"expertmesh_L{l2}_b{b}")
            mine = first_tokens.get(f"{m}_L{l2}_b{b}")
            same = (
                None
                if ref is None or mine is None or m == "hf"
                else sum(x == y for x, y in zip(ref, mine)) / len(ref)
            )
            rows.append(dict(mode=m, batch=b, per_layer_ms=per_layer, fixed_ms=fixed, tok_s=tok_s,
                             transport=transports.get(m, ""), same_tokens=same,
                             pieces_us=pieces.get(m, {}).get(l2, {}).get(b), linked=linked.get(m),
                             step_ms={str(d): res[m][d][b] for d in args.depths}))  # fmt: skip
    ctx = args.prompt + args.new // 2
    floors = {b: floor_bytes(sizes, widths, b, ctx) / bw * 1e3 for b in args.batches}
    inproc = {r["batch"]: r["per_layer_ms"] for r in rows if r["mode"] == "expertmesh"}
    rt_ms = (switch.get("kernel", float("nan")) - switch.get("none", 0.0)) * 1e-3 if switch else float("nan")
    two_proc = {b: inproc[b] + rt_ms for b in args.batches}
    report = dict(model=args.model, layer_bytes=sizes, device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  gpus=torch.cuda.device_count() if args.device.startswith("cuda") else 0,
                  torch=torch.__version__, args=vars(args), copy_bw_GBs=bw / 1e9, rows=rows,
                  floor_ms_per_layer=floors, context_switch_us=switch, two_process_floor_ms=two_proc,
                  first_tokens=first_tokens, failed=failed, kv_bytes_per_token_layer=kv_bytes)  # fmt: skip
    (out / "bench_e2e.json").write_text(json.dumps(report, indent=1))
    print(
        f"\n{args.model}: {report['device']} x{report['gpus']}, torch {torch.__version__}, copy bandwidth "
        f"{bw / 1e9:.0f} GB/s, same-GPU context switch {rt_ms * 1e3:.0f} us per round trip"
    )
    print(f"linked decode steps / re-runs without the link (last depth, all batches): {linked}")
    print(f"| mode | transport | batch | per-layer ms | fixed ms | tok/s at {real} layers | HBM floor per layer ms "
          "| two-process floor ms | greedy tokens = in process | per-layer pieces us (replay+sync / route+send / wait; route / send / server / send's end to answer summed) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tp = f"{two_proc[r['batch']]:.3f}" if r["mode"].startswith("gpu-server same") else ""
        same = "" if r["same_tokens"] is None else f"{r['same_tokens']:.2f}"
        pc = "" if not r["pieces_us"] else " / ".join(f"{x:.0f}" for x in r["pieces_us"])
        print(f"| {r['mode']} | {r['transport']} | {r['batch']} | {r['per_layer_ms']:.3f} | {r['fixed_ms']:.2f} | "
              f"{r['tok_s']:.0f} | {floors[r['batch']]:.3f} | {tp} | {same} | {pc} |")  # fmt: skip


if __name__ == "__main__":
    main()
