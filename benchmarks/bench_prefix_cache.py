"""Prefix caching: the coordinator's scheduler and engine in this process, the same workloads
with the prefix cache on and off (``--no-prefix-cache``) in one run.

Two workloads (``--parts``):

  chat    a multi-turn chat replay: ``--conversations`` conversations run at once, each of
          ``--turns`` turns; a turn's prompt is the conversation so far (a system prompt of
          ``--system`` tokens shared by every conversation, then each earlier message and reply)
          plus a new message of ``--message`` tokens, and the reply is ``--reply`` greedy
          tokens. A conversation sends its next turn when its reply is complete. Reported: total
          time, requests/s, prompt tokens served from the cache, and whether every reply was the
          same token for token with and without the cache.
  shared  one ``--prefix``-token prefix with ``--suffixes`` distinct ``--suffix``-token endings,
          sent one at a time (one new token each): time to first token of the first request
          (nothing cached) against the median of the others (the prefix cached), and the
          median without the cache (over ``--off-suffixes`` requests, to bound a slow setup).

Prompts are random token ids (seeded), so speed does not depend on the weights. Before the timed
parts each engine serves two untimed requests as long as the shared part's (a prefix, then an
extension of it), so that kernels compiled on first use (Triton on CUDA) are not timed.

The model defaults to the demo model. ``--real-width qwen3-30b-a3b`` (or ``deepseek-v2-lite``)
writes a random checkpoint of that model's published config (benchmarks/fullsize_ckpt.py) with
``--layers`` decoder layers instead of the published depth (0 = all of them): every width is
the real one, only the depth is cut, so per-layer costs are the full-size model's and the totals
are a fraction of them; ``--ckpt-dir`` keeps it for the next run. ``tiny`` is a CPU smoke test.

Setups (``--setups``, each run with the cache off and on):

  inproc     every expert in the engine's process (LocalDispatcher);
  local+cpu  the hybrid: ``--gpu-share`` of each layer's experts in the coordinator's process
             (the cluster member ``local``, as ``--num-gpu-experts`` with ``--cpu-server``), the
             rest on an ``expertmesh cpu-server`` started here;
  gpu+cpu    the same split over an ``expertmesh gpu-server`` on ``--device`` and a cpu-server.

On the CPU the two modes' engines stay up and take turns, each mode's fastest of ``--repeat``
runs kept (a busy host's noise hits both alike); on CUDA one mode runs after the other (two
engines of a large model need not fit at once). A setup with servers starts them per mode.

    python benchmarks/bench_prefix_cache.py                   # 2-core CPU, demo model
    # the device benchmark (2k shared prefix, 64 suffixes of 64; chat replay), 2-GPU host:
    python benchmarks/bench_prefix_cache.py --device cuda:0 --dtype bfloat16 \\
        --real-width qwen3-30b-a3b --layers 8 --ckpt-dir /tmp/q3-8l \\
        --setups inproc local+cpu --parts shared chat --pages 8192 \\
        --conversations 8 --turns 6 --system 512 --message 128 --reply 32 \\
        --off-suffixes 16 --repeat 1

Shapes: none (token counts only).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import queue
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.config import DTYPES  # noqa: E402
from coordinator.experts.cluster import ExpertCluster  # noqa: E402
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec  # noqa: E402
from coordinator.experts.local import connector  # noqa: E402
from coordinator.experts.remote import RemoteDispatcher  # noqa: E402
from coordinator.model.dispatch import Dispatcher, LocalDispatcher  # noqa: E402
from coordinator.model.engine import Engine  # noqa: E402
from coordinator.model.kv_cache import KVCacheSpec  # noqa: E402
from coordinator.model.loader import load_model  # noqa: E402
from coordinator.serving.outputs import Output  # noqa: E402
from coordinator.serving.sampler import SamplingParams  # noqa: E402
from coordinator.serving.scheduler import Scheduler, SchedulerLimits  # noqa: E402
from coordinator.serving.scheduler_threads import SMALL_STEP_WORK  # noqa: E402
from expertmesh.checkpoint import CheckpointReader  # noqa: E402

_LISTEN = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class Done:
    """One finished request: its tokens, when its first token came, its cached prompt tokens."""

    tokens: list[int] = field(default_factory=list)
    first: float = 0.0
    cached: int = 0
    error: BaseException | None = None


SETUPS = ("inproc", "local+cpu", "gpu+cpu")


def make_scheduler(args, model: Path, prefix: bool, servers: list[tuple[str, str]]) -> Scheduler:
    """An engine and its scheduler: experts in process, or split over ``servers`` ((kind,
    address); kind ``local`` is the coordinator's own share, the hybrid's in-process member)."""
    dtype, dev = DTYPES[args.dtype], torch.device(args.device)
    reader = CheckpointReader(str(model))
    dispatcher: Dispatcher
    if servers:
        specs = tuple(
            ServerSpec.local() if kind == "local" else ServerSpec(f"{kind}{i}", addr, kind)
            for i, (kind, addr) in enumerate(servers)
        )
        share = round(args.gpu_share * reader.config.num_experts)
        cfg = ClusterConfig(specs, num_gpu_experts=share, timeout_s=300)
        local = connector(str(model), dtype, dev) if any(k == "local" for k, _ in servers) else None
        remote = RemoteDispatcher(
            reader.config, cfg, dtype, args.device, ExpertCluster(reader.config, cfg, dev, local=local)
        )
        remote.connect(300)
        dispatcher = remote
    else:
        dispatcher = LocalDispatcher(reader, dtype, dev)
    spec = KVCacheSpec(args.pages, args.page_size)
    eng = Engine(load_model(reader, dtype, dev), dispatcher, spec, dtype, dev, prefix_cache=prefix)
    context = min(eng.config.max_position_embeddings, args.pages * args.page_size)
    limits = SchedulerLimits(max_batch_tokens=args.max_batch_tokens, max_running=64, max_context=context)
    s = Scheduler(eng, limits)
    s.start()
    return s


def submit(s: Scheduler, prompt: list[int], new: int, tag: object, inbox: queue.Queue) -> float:
    """Sends ``prompt``; ``inbox`` gets (tag, Done) when it finishes. Returns the send time."""
    done = Done()

    def sink(out: Output) -> None:  # scheduler thread
        if out.token_ids and not done.tokens:
            done.first = time.perf_counter()
        done.tokens += out.token_ids
        if out.finish_reason is not None:
            done.cached, done.error = out.cached_tokens, out.error
            inbox.put((tag, done))

    t0 = time.perf_counter()
    s.submit(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True), sink)
    return t0


def one(s: Scheduler, prompt: list[int], new: int) -> tuple[float, Done]:
    """(time to first token, the result) of ``prompt`` sent alone."""
    inbox: queue.Queue = queue.Queue()
    t0 = submit(s, prompt, new, None, inbox)
    _, done = inbox.get(timeout=600)
    if done.error is not None:
        raise RuntimeError(f"request failed: {done.error}")
    return done.first - t0, done


def chat(args, s: Scheduler, vocab: int, seed: int) -> dict:
    g = random.Random(seed)
    tok = lambda n: [g.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    system = tok(args.system)
    messages = [[tok(args.message) for _ in range(args.turns)] for _ in range(args.conversations)]
    history = [system + m[0] for m in messages]
    turn = [0] * args.conversations
    replies: list[list[list[int]]] = [[] for _ in range(args.conversations)]
    inbox: queue.Queue = queue.Queue()
    sent: dict[int, float] = {}
    ttft: list[float] = []
    prompt_tokens = cached = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for c in range(args.conversations):
        sent[c] = submit(s, history[c], args.reply, c, inbox)
    left = args.conversations * args.turns
    while left:
        c, done = inbox.get(timeout=600)
        if done.error is not None:
            raise RuntimeError(f"request failed: {done.error}")
        left -= 1
        ttft.append(done.first - sent[c])
        prompt_tokens += len(history[c])
        cached += done.cached
        replies[c].append(done.tokens)
        turn[c] += 1
        if turn[c] < args.turns:
            history[c] = history[c] + done.tokens + messages[c][turn[c]]
            sent[c] = submit(s, history[c], args.reply, c, inbox)
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    n = args.conversations * args.turns
    return {
        "seconds": total,
        "cpu_seconds": cpu,
        "requests_per_s": n / total,
        "requests": n,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "mean_ttft_s": statistics.mean(ttft),
        "replies": replies,
    }


def shared(args, s: Scheduler, vocab: int, seed: int) -> dict:
    g = random.Random(seed + 1)
    prefix = [g.randrange(2, vocab) for _ in range(args.prefix)]
    n = args.suffixes if s.engine.prefix is not None or not args.off_suffixes else args.off_suffixes
    suffixes = [[g.randrange(2, vocab) for _ in range(args.suffix)] for _ in range(max(2, n))]
    times, cached = [], []
    for suf in suffixes:
        t, done = one(s, prefix + suf, 1)
        times.append(t)
        cached.append(done.cached)
    return {
        "first_ttft_s": times[0],
        "repeat_ttft_s": statistics.median(times[1:]),
        "first_cached": cached[0],
        "repeat_cached": statistics.median(cached[1:]),
        "requests": len(times),
    }


def start_server(kind: str, args, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``expertmesh {kind}-server`` in its own process; returns it and its address."""
    cmd = [sys.executable, "-m", "expertmesh.cli", f"{kind}-server", "--model", str(model), "--port", "0",
           "--dtype", args.dtype]  # fmt: skip
    if kind == "gpu":
        cmd += ["--device", args.device]
    if kind == "cpu" and args.cpu_threads:
        cmd += ["--threads", str(args.cpu_threads)]
    # NOTE: ROOT first, the caller's path kept: a host whose wheels live on PYTHONPATH (the
    # device machines') must give the server the same packages as this process
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    assert proc.stdout is not None
    out = open(log, "a")  # noqa: SIM115 (the drain thread writes to it until the server exits)
    for line in proc.stdout:
        out.write(line)
        m = _LISTEN.search(line)
        if m:
            threading.Thread(target=lambda: out.writelines(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
            return proc, f"127.0.0.1:{m.group(2)}"
    proc.wait()
    raise RuntimeError(f"{kind}-server did not start (exit {proc.returncode}; log: {log})")


def warm_up(args, s: Scheduler, vocab: int) -> None:
    """Untimed: a short request, then one as long as the shared part's and an extension of it
    (prefill, cached-prefix extend and decode kernels compiled and allocations made)."""
    one(s, [5, 6, 7], 2)
    # NOTE: a string seed: random.Random(-n) is Random(n), and the shared part's prefix is
    # drawn from Random(seed + 1); a warm-up with its tokens would make its first request a hit
    g = random.Random("warm-up")
    n = min(args.prefix + args.suffix, s.limits.max_context - 2) if "shared" in args.parts else 64
    long = [g.randrange(2, vocab) for _ in range(n)]
    one(s, long[: n - n // 8], 2)
    one(s, long, 2)


def run_modes(args, scheds: dict[str, Scheduler], runs: dict[str, dict[str, list[dict]]]) -> None:
    """``--repeat`` rounds of the parts on each scheduler in turn (results into ``runs``); each
    round has prompts of its own seed (a round finds nothing of the last one cached). Stops them."""
    try:
        vocab = next(iter(scheds.values())).engine.config.vocab_size
        for s in scheds.values():
            check_fits(args, s.limits.max_context)
            warm_up(args, s, vocab)
        for rep in range(args.repeat):
            for key, s in scheds.items():
                seed = args.seed + 1000 * rep
                t0 = time.perf_counter()
                if "shared" in args.parts:
                    runs.setdefault("shared", {}).setdefault(key, []).append(shared(args, s, vocab, seed))
                if "chat" in args.parts:
                    runs.setdefault("chat", {}).setdefault(key, []).append(chat(args, s, vocab, seed))
                print(f"  {key} round {rep + 1}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    finally:
        for s in scheds.values():
            s.stop()
            s.engine.dispatcher.close()


def check_fits(args, context: int) -> None:
    longest = {
        "chat": args.system + args.turns * (args.message + args.reply),
        "shared": args.prefix + args.suffix + 1,
    }
    for part in args.parts:
        if longest[part] > context:
            raise SystemExit(
                f"{part}: requests of up to {longest[part]} tokens do not fit the max context of "
                f"{context} (the model's positions, or --pages x --page-size): shrink the workload"
            )


def prepare_model(args, work: Path) -> tuple[Path, str]:
    if args.model:
        return Path(args.model), args.model
    if args.real_width:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from fullsize_ckpt import CONFIGS, tiny_overrides, write_checkpoint

        name = "qwen3-30b-a3b" if args.real_width == "tiny" else args.real_width
        over: dict = {"num_hidden_layers": args.layers} if args.layers else {}
        if args.real_width == "tiny":  # small widths and few experts: the CPU smoke test of this path
            over.update(tiny_overrides(name), experts=8, hidden_size=64)
        out = Path(args.ckpt_dir) if args.ckpt_dir else work / "ckpt"
        t0 = time.perf_counter()
        summary, wrote = write_checkpoint(name, out, over, args.device)
        print(f"checkpoint {'written' if wrote else 'reused'} in {time.perf_counter() - t0:.1f} s: {summary}",
              file=sys.stderr)  # fmt: skip
        depth = CONFIGS[name]["num_hidden_layers"]
        what = (
            "tiny widths"
            if args.real_width == "tiny"
            else f"real widths, {summary['layers']} of {depth} layers"
        )
        return out, f"random {name}, {what}, {summary['bytes'] / 1e9:.1f} GB"
    from expertmesh.demo import write_demo_model

    return write_demo_model(work / "demo-model"), "demo model"


def run_setup(args, setup: str, model: Path, tmp: Path) -> dict[str, dict[str, list[dict]]]:
    """Both modes of one setup; returns each part's runs per mode."""
    runs: dict[str, dict[str, list[dict]]] = {}
    kinds = {"inproc": [], "local+cpu": ["local", "cpu"], "gpu+cpu": ["gpu", "cpu"]}[setup]
    if not kinds and args.device == "cpu":
        # both engines stay up and take turns, so that a busy host's noise hits both alike
        run_modes(
            args, {k: make_scheduler(args, model, k == "cache", []) for k in ("no_cache", "cache")}, runs
        )
        return runs
    for key in ("no_cache", "cache"):
        # NOTE: an expert server follows one coordinator's placement: each mode gets servers of its own
        procs = [start_server(k, args, model, tmp / f"{k}-{key}.log") for k in kinds if k != "local"]
        try:
            addrs, it = [], iter(procs)
            for k in kinds:
                addrs.append((k, "") if k == "local" else (k, next(it)[1]))
            run_modes(args, {key: make_scheduler(args, model, key == "cache", addrs)}, runs)
        finally:
            for proc, _ in procs:
                proc.terminate()
                proc.wait(30)
        gc.collect()  # the mode's engine, before the next one loads
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return runs


def summarise(runs: dict[str, dict[str, list[dict]]]) -> dict:
    """Each mode's fastest repeat (the least disturbed by other work on the host)."""
    res: dict = {
        "chat": {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.get("chat", {}).items()},
        "shared": {k: min(v, key=lambda r: r["repeat_ttft_s"]) for k, v in runs.get("shared", {}).items()},
    }
    if "chat" in runs:
        pairs = list(zip(runs["chat"]["no_cache"], runs["chat"]["cache"]))
        res["chat_same_replies"] = all(a["replies"] == b["replies"] for a, b in pairs)
        # NOTE: a reply is part of its conversation's next prompts, so after the first reply that
        # differs the rest of that conversation is a different workload: count the conversations
        # that agree to the end and, for the others, the turn of the first difference
        firsts = []
        for a, b in pairs:
            for ra, rb in zip(a["replies"], b["replies"]):
                firsts.append(next((t for t, (x, y) in enumerate(zip(ra, rb)) if x != y), None))
        res["chat_conversations_equal"] = f"{firsts.count(None)} of {len(firsts)}"
        res["chat_first_difference_turns"] = sorted(t + 1 for t in firsts if t is not None)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF checkpoint directory (default: the demo model)")
    ap.add_argument(
        "--real-width",
        default="",
        choices=["", "qwen3-30b-a3b", "deepseek-v2-lite", "tiny"],
        help="a random checkpoint of this published config, --layers deep (tiny: a CPU smoke test)",
    )
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of --real-width (0: published)")
    ap.add_argument("--ckpt-dir", default="", help="where --real-width writes (reused if the same)")
    ap.add_argument("--setups", nargs="+", default=["inproc"], choices=SETUPS)
    ap.add_argument("--gpu-share", type=float, default=0.5, help="experts in the coordinator / gpu-server")
    ap.add_argument("--cpu-threads", type=int, default=0, help="the cpu-server's --threads (0: its default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--parts", nargs="+", default=["chat"], choices=["chat", "shared"])
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=512, help="the coordinator's default")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=128, help="system prompt tokens (shared)")
    ap.add_argument("--message", type=int, default=48, help="tokens of each new user message")
    ap.add_argument("--reply", type=int, default=8, help="tokens generated per turn")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--suffixes", type=int, default=64)
    ap.add_argument(
        "--off-suffixes", type=int, default=0, help="shared-part requests without the cache (0: --suffixes)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs of each mode, taking turns; the fastest is kept"
    )
    ap.add_argument("--json", default="", help="also write the numbers here")
    args = ap.parse_args()
    if not 0 <= args.gpu_share <= 1:
        raise SystemExit(f"--gpu-share {args.gpu_share}: expected a fraction in [0, 1]")
    # NOTE: set on this thread before any load: the schedulers take it as the count to run large
    # steps with, and a checkpoint reader pool's setting for its own threads must not leak into it
    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model, what = prepare_model(args, Path(tmp))
        res: dict = {"model": what, "device": args.device, "dtype": args.dtype, "host": platform.node()}
        res["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())  # other work on the host, 1/5/15 min
        res["setups"] = {}
        for setup in args.setups:
            print(f"{setup}: ...", file=sys.stderr)
            res["setups"][setup] = summarise(run_setup(args, setup, model, Path(tmp)))
    res["seconds"] = time.perf_counter() - t0
    report(res, args)


def report(res: dict, args) -> None:
    print(
        f"model: {res['model']}, {res['device']} {res['dtype']}, page size {args.page_size}, "
        f"torch threads {args.threads} (one for a CPU step under {SMALL_STEP_WORK} tokens x hidden), "
        f"host load average {res['load']}; "
        f"{res['seconds']:.0f} s in all"
    )
    rows = []
    for setup, r in res["setups"].items():
        print(f"\n### {setup}: {setup_text(setup, args)}")
        rows.append((setup, report_setup(r, args)))
        for c in r["chat"].values():
            c.pop("replies")
    if len(rows) > 1 or args.device != "cpu":
        print("\nsummary")
        print("| setup | chat req/s off | chat req/s on | chat speed-up | first TTFT ms (cache on) | "
              "repeat TTFT ms (on) | first / repeat | repeat TTFT ms (off) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for setup, cells in rows:
            print(f"| {setup} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


def setup_text(setup: str, args) -> str:
    if setup == "inproc":
        return "every expert in the engine's process"
    where = "the coordinator's process (local)" if setup == "local+cpu" else "a gpu-server"
    return f"{args.gpu_share:.0%} of each layer's experts in {where}, the rest on a cpu-server"


def report_setup(res: dict, args) -> list[str]:
    """Prints a setup's tables; returns its summary cells."""
    cells = ["-"] * 7
    if res["chat"]:
        a, b = res["chat"]["no_cache"], res["chat"]["cache"]
        print(
            f"\nchat replay: {args.conversations} conversations x {args.turns} turns, system {args.system}, "
            f"message {args.message}, reply {args.reply} tokens; fastest of {args.repeat} runs each"
        )
        print(
            "| prefix cache | total s | process CPU s | requests/s | mean TTFT ms | prompt tokens | cached |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, r in (("off", a), ("on", b)):
            print(
                f"| {name} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | {r['requests_per_s']:.2f} "
                f"| {r['mean_ttft_s'] * 1e3:.1f} | {r['prompt_tokens']} | {r['cached_tokens']} |"
            )
        res["chat_speedup"] = a["seconds"] / b["seconds"]
        print(
            f"speed-up (total time off / on): {res['chat_speedup']:.2f}x; "
            f"replies identical in every run: {res['chat_same_replies']} (conversations equal to the "
            f"end: {res['chat_conversations_equal']}; first differing turn of the others: "
            f"{res['chat_first_difference_turns'] or '-'})"
        )
        cells[:3] = [
            f"{a['requests_per_s']:.2f}",
            f"{b['requests_per_s']:.2f}",
            f"{res['chat_speedup']:.2f}x",
        ]
    if res["shared"]:
        a, b = res["shared"]["no_cache"], res["shared"]["cache"]
        print(f"\nshared prefix: {args.prefix} tokens + distinct {args.suffix}-token suffixes, one at a time")
        print(
            "| prefix cache | requests | first TTFT ms | median TTFT of the rest ms | cached tokens (rest) |"
        )
        print("|---|---|---|---|---|")
        for name, r in (("off", a), ("on", b)):
            print(
                f"| {name} | {r['requests']} | {r['first_ttft_s'] * 1e3:.1f} | {r['repeat_ttft_s'] * 1e3:.1f} "
                f"| {r['repeat_cached']:.0f} |"
            )
        res["shared_ratio"] = b["first_ttft_s"] / b["repeat_ttft_s"]
        res["shared_ratio_vs_off"] = a["repeat_ttft_s"] / b["repeat_ttft_s"]
        print(
            f"TTFT with the cache, first / median of the rest: {res['shared_ratio']:.2f}x (one first "
            f"request: noisy); without the cache / with it, medians: {res['shared_ratio_vs_off']:.2f}x"
        )
        cells[3:] = [f"{b['first_ttft_s'] * 1e3:.1f}", f"{b['repeat_ttft_s'] * 1e3:.1f}",
                     f"{res['shared_ratio']:.1f}x", f"{a['repeat_ttft_s'] * 1e3:.1f}"]  # fmt: skip
    return cells


if __name__ == "__main__":
    main()
