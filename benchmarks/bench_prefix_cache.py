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
          median without the cache.

Prompts are random token ids (seeded), so speed does not depend on the weights. The model
defaults to the demo model; ``--real-width`` writes a random checkpoint of a real model's widths
(benchmarks/bench_e2e.py) with ``--layers`` decoder layers instead.

Experts run in this process by default. ``--servers gpu cpu`` starts those expert servers
(``expertmesh gpu-server`` on ``--device``, ``expertmesh cpu-server``) and both engines send
every MoE layer to them (half of the experts on each when there are two: the hybrid setup).

    python benchmarks/bench_prefix_cache.py                   # 2-core CPU, demo model
    python benchmarks/bench_prefix_cache.py --device cuda --dtype bfloat16 \\
        --real-width qwen3-30b-a3b --layers 8 --parts shared chat [--servers gpu cpu]

Shapes: none (token counts only).
"""

from __future__ import annotations

import argparse
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
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec  # noqa: E402
from coordinator.experts.remote import RemoteDispatcher  # noqa: E402
from coordinator.model.dispatch import Dispatcher, LocalDispatcher  # noqa: E402
from coordinator.model.engine import Engine  # noqa: E402
from coordinator.model.kv_cache import KVCacheSpec  # noqa: E402
from coordinator.model.loader import load_model  # noqa: E402
from coordinator.serving.outputs import Output  # noqa: E402
from coordinator.serving.sampler import SamplingParams  # noqa: E402
from coordinator.serving.scheduler import Scheduler, SchedulerLimits  # noqa: E402
from expertmesh.checkpoint import CheckpointReader  # noqa: E402

_LISTEN = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class Done:
    """One finished request: its tokens, when its first token came, its cached prompt tokens."""

    tokens: list[int] = field(default_factory=list)
    first: float = 0.0
    cached: int = 0
    error: BaseException | None = None


def make_scheduler(args, model: Path, prefix: bool, servers: list[tuple[str, str]]) -> Scheduler:
    """An engine (experts in process, or on ``servers``: (kind, address)) and its scheduler."""
    dtype, dev = DTYPES[args.dtype], torch.device(args.device)
    reader = CheckpointReader(str(model))
    dispatcher: Dispatcher
    if servers:
        specs = tuple(ServerSpec(f"{kind}{i}", addr, kind) for i, (kind, addr) in enumerate(servers))
        remote = RemoteDispatcher(reader.config, ClusterConfig(specs, timeout_s=120), dtype, args.device)
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
    suffixes = [[g.randrange(2, vocab) for _ in range(args.suffix)] for _ in range(args.suffixes)]
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
    }


def start_server(kind: str, args, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``expertmesh {kind}-server`` in its own process; returns it and its address."""
    cmd = [sys.executable, "-m", "expertmesh.cli", f"{kind}-server", "--model", str(model), "--port", "0",
           "--dtype", args.dtype]  # fmt: skip
    if kind == "gpu":
        cmd += ["--device", args.device]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
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


def run_modes(args, scheds: dict[str, Scheduler], runs: dict[str, dict[str, list[dict]]]) -> None:
    """``--repeat`` rounds of the parts on each scheduler in turn (results into ``runs``); each
    round has prompts of its own seed (a round finds nothing of the last one cached). Stops them."""
    try:
        vocab = next(iter(scheds.values())).engine.config.vocab_size
        for s in scheds.values():
            check_fits(args, s.limits.max_context)
            one(s, [5, 6, 7], 2)  # warm-up (first-use kernels and allocations), not timed
        for rep in range(args.repeat):
            for key, s in scheds.items():
                seed = args.seed + 1000 * rep
                if "shared" in args.parts:
                    runs.setdefault("shared", {}).setdefault(key, []).append(shared(args, s, vocab, seed))
                if "chat" in args.parts:
                    runs.setdefault("chat", {}).setdefault(key, []).append(chat(args, s, vocab, seed))
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
        from bench_e2e import MODELS, TINY, write_checkpoint

        out = work / f"{args.real_width}-{args.layers}l"
        widths = {"tiny": TINY, **MODELS}[args.real_width]
        w = dict(widths, max_position_embeddings=args.pages * args.page_size)
        write_checkpoint(out, w, args.layers, DTYPES[args.dtype], args.device)  # random init on the device
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the HF model written is garbage now
        return out, f"random {args.real_width} widths, {args.layers} layers"
    from expertmesh.demo import write_demo_model

    return write_demo_model(work / "demo-model"), "demo model"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF checkpoint directory (default: the demo model)")
    ap.add_argument(
        "--real-width",
        default="",
        choices=["", "qwen3-30b-a3b", "deepseek-v2-lite", "tiny"],
        help="a random checkpoint of these widths (tiny: a smoke test of this path)",
    )
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the --real-width checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs of each mode, taking turns; the fastest is kept"
    )
    ap.add_argument(
        "--servers", nargs="*", default=[], choices=["gpu", "cpu"], help="expert servers to start"
    )
    ap.add_argument("--json", default="", help="also write the numbers here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, what = prepare_model(args, Path(tmp))
        res: dict = {"model": what, "device": args.device, "dtype": args.dtype, "host": platform.node()}
        res["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())  # other work on the host, 1/5/15 min
        res["servers"] = " + ".join(args.servers) or "none (experts in process)"
        runs: dict[str, dict[str, list[dict]]] = {}
        if args.servers:
            # an expert server follows one coordinator's placement: each mode gets servers of
            # its own, one mode after the other
            for key in ("no_cache", "cache"):
                procs = [start_server(k, args, model, Path(tmp) / f"{k}-{key}.log") for k in args.servers]
                try:
                    addrs = [(k, addr) for k, (_, addr) in zip(args.servers, procs)]
                    run_modes(args, {key: make_scheduler(args, model, key == "cache", addrs)}, runs)
                finally:
                    for proc, _ in procs:
                        proc.terminate()
                        proc.wait(30)
        else:
            # both engines stay up and take turns, so that a busy host's noise hits both alike
            run_modes(
                args, {k: make_scheduler(args, model, k == "cache", []) for k in ("no_cache", "cache")}, runs
            )
        # the fastest repeat of each mode (the least disturbed by other work on the host)
        res["chat"] = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.get("chat", {}).items()}
        res["shared"] = {
            k: min(v, key=lambda r: r["repeat_ttft_s"]) for k, v in runs.get("shared", {}).items()
        }
        if "chat" in runs:
            res["chat_same_replies"] = all(
                a["replies"] == b["replies"] for a, b in zip(runs["chat"]["no_cache"], runs["chat"]["cache"])
            )
    report(res, args)


def report(res: dict, args) -> None:
    print(
        f"model: {res['model']}, {res['device']} {res['dtype']}, page size {args.page_size}, "
        f"torch threads {torch.get_num_threads()}, expert servers {res['servers']}, "
        f"host load average {res['load']}"
    )
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
            f"replies identical in every run: {res['chat_same_replies']}"
        )
        for r in (a, b):
            r.pop("replies")
    if res["shared"]:
        a, b = res["shared"]["no_cache"], res["shared"]["cache"]
        print(
            f"\nshared prefix: {args.prefix} tokens + {args.suffixes} distinct {args.suffix}-token suffixes"
        )
        print("| prefix cache | first TTFT ms | median TTFT of the rest ms | cached tokens (rest) |")
        print("|---|---|---|---|")
        for name, r in (("off", a), ("on", b)):
            print(
                f"| {name} | {r['first_ttft_s'] * 1e3:.1f} | {r['repeat_ttft_s'] * 1e3:.1f} "
                f"| {r['repeat_cached']:.0f} |"
            )
        res["shared_ratio"] = b["first_ttft_s"] / b["repeat_ttft_s"]
        res["shared_ratio_vs_off"] = a["repeat_ttft_s"] / b["repeat_ttft_s"]
        print(
            f"TTFT with the cache, first / median of the rest: {res['shared_ratio']:.2f}x (one first "
            f"request: noisy); without the cache / with it, medians: {res['shared_ratio_vs_off']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
