"""Serving benchmark: requests/s, time to first token (TTFT) and time per output token (TPOT)
at several concurrencies, through the public gRPC API and/or the OpenAI-compatible HTTP API.

    python benchmarks/bench_serving.py [--model DIR] [--concurrency 1 8 32] [--new-tokens 32]
        [--apis grpc http]

Modes (each a fresh set of child processes started with the real CLI):
  cluster     ``expertmesh up``: coordinator + GPU expert server (``--device cpu`` here) + CPU
              expert server, half the experts on each; every MoE layer of every step crosses
              two loopback gRPC streams.
  in-process  ``expertmesh coordinator`` alone, every expert in process: the baseline the
              cluster is compared with (ratio = cluster / in-process).

APIs (``--apis``, each mode serves both at once): ``grpc`` streams ``Generation/Generate``;
``http`` streams ``POST /v1/completions`` (SSE, token-id prompt, ``stream_options.include_usage``
for the token count) with httpx, so the two rows of a mode differ only by the API layer.

Clients are closed-loop: ``c`` workers each send their next request when the previous one
finished; each level runs ``max(2c, 8)`` requests after one warm-up request. Greedy,
``ignore_eos`` so every request produces exactly ``--new-tokens`` tokens.

The model defaults to the demo model (``expertmesh.demo.write_demo_model``); where its weights
are not built yet, a random-weight checkpoint of the same architecture stands in (speed does
not depend on the weights with ``ignore_eos``) and the table says so.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from expertmesh.client import AsyncClient  # noqa: E402
from expertmesh.health import check  # noqa: E402


def prepare_model(arg: str | None, workdir: Path) -> tuple[Path, str]:
    if arg:
        return Path(arg), arg
    from expertmesh.demo import DemoModelMissing, write_demo_model

    try:
        return write_demo_model(workdir / "demo"), "demo model"
    except DemoModelMissing:
        pass
    # stand-in: the demo architecture with random weights (transformers: a dev dependency)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from expertmesh.demo.train import MODEL

    kw = {**MODEL, "vocab_size": 1024}
    cfg = AutoConfig.for_model(str(kw.pop("model_type")), **kw)
    torch.manual_seed(0)
    out = workdir / "demo-arch-random"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out, "demo architecture, random weights (demo weights not built yet)"


@dataclass
class Proc:
    proc: subprocess.Popen
    addr: str
    http: str  # base URL of the HTTP API
    name: str  # the model's name there (its directory's)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(mode: str, model: Path, threads: int) -> Proc:
    cli = [sys.executable, "-m", "expertmesh.cli"]
    http_port = free_port()
    if mode == "cluster":
        cmd = [*cli, "up", "--model", str(model), "--device", "cpu", "--threads", str(threads)]
        pattern = re.compile(r"serving on (\S+:\d+)")
    else:
        cmd = [*cli, "coordinator", "--model", str(model), "--port", "0", "--threads", str(threads)]
        pattern = re.compile(r"listening on (\S+:\d+)")
    cmd += ["--http-port", str(http_port)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (open as long as the child runs)
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    assert p.stdout is not None
    for line in p.stdout:
        m = pattern.search(line)
        if m:
            addr = m.group(1)
            deadline = time.monotonic() + 120
            while check(addr, 1.0) != "SERVING":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: {addr} never became SERVING")
                time.sleep(0.2)
            return Proc(p, addr, f"http://127.0.0.1:{http_port}", model.resolve().name)
    log.seek(0)
    raise RuntimeError(f"{mode}: {' '.join(cmd)} exited with {p.wait()}:\n{log.read()[-3000:]}")


@dataclass
class Sample:
    ttft: float
    tpot: float
    tokens: int


async def one_request(client: AsyncClient, ids: list[int], new_tokens: int) -> Sample:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async for chunk in client.stream(input_ids=ids, max_new_tokens=new_tokens, ignore_eos=True):
        if chunk.token_ids:
            last = time.perf_counter()
            first = first or last
            n += len(chunk.token_ids)
    assert first is not None and last is not None and n == new_tokens, n
    return Sample(first - t0, (last - first) / max(1, n - 1), n)


async def one_http_request(client: httpx.AsyncClient, name: str, ids: list[int], new_tokens: int) -> Sample:
    body = {
        "model": name, "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    assert first is not None and last is not None and n == new_tokens, n
    return Sample(first - t0, (last - first) / max(1, n - 1), n)


async def run_level(
    proc: Proc, api: str, conc: int, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[Sample]]:
    if api == "http":
        limits = httpx.Limits(max_connections=conc + 1)
        client = httpx.AsyncClient(base_url=proc.http, timeout=600, limits=limits)

        async def one(ids: list[int], n: int) -> Sample:
            return await one_http_request(client, proc.name, ids, n)
    else:
        client = AsyncClient(proc.addr)  # type: ignore[assignment]

        async def one(ids: list[int], n: int) -> Sample:
            return await one_request(client, ids, n)  # type: ignore[arg-type]

    async with client:
        await one(prompts[0], 4)  # warm-up
        todo = list(prompts)
        samples: list[Sample] = []

        async def worker() -> None:
            while todo:
                samples.append(await one(todo.pop(), new_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return time.perf_counter() - t0, samples


async def overhead(proc: Proc, prompt: list[int], reps: int) -> dict[str, list[float]]:
    """One-token requests, gRPC and HTTP alternating (so both see the same load), whole
    responses: what each API layer adds per request when the model's work is one step."""
    out: dict[str, list[float]] = {"grpc": [], "http": []}
    body = {"model": proc.name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with AsyncClient(proc.addr) as g, httpx.AsyncClient(base_url=proc.http, timeout=60) as h:
        for i in range(reps + 5):  # the first 5 pairs warm up
            t0 = time.perf_counter()
            await g.generate(input_ids=prompt, max_new_tokens=1)
            t1 = time.perf_counter()
            (await h.post("/v1/completions", json=body)).raise_for_status()
            t2 = time.perf_counter()
            if i >= 5:
                out["grpc"].append(t1 - t0)
                out["http"].append(t2 - t1)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--modes", nargs="+", default=["in-process", "cluster"], choices=["in-process", "cluster"]
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--apis", nargs="+", default=["grpc"], choices=["grpc", "http"])
    ap.add_argument(
        "--overhead-reps", type=int, default=0, help="also time N alternating one-token gRPC/HTTP requests"
    )
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model, what = prepare_model(args.model, Path(tmp))
        from expertmesh.config import ModelConfig

        vocab = ModelConfig.from_dir(model).vocab_size
        rng = random.Random(0)
        rows: dict[tuple[str, str, int], tuple] = {}
        lat: dict[str, dict[str, list[float]]] = {}
        for mode in args.modes:
            proc = launch(mode, model, args.threads)
            try:
                for conc, api in itertools.product(args.concurrency, args.apis):
                    n = max(2 * conc, 8)
                    prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_tokens)] for _ in range(n)]
                    wall, s = asyncio.run(run_level(proc, api, conc, prompts, args.new_tokens))
                    rows[mode, api, conc] = (
                        n,
                        n / wall,
                        sum(x.tokens for x in s) / wall,
                        statistics.median(x.ttft for x in s) * 1e3,
                        pct([x.ttft for x in s], 0.9) * 1e3,
                        statistics.median(x.tpot for x in s) * 1e3,
                        pct([x.tpot for x in s], 0.9) * 1e3,
                    )
                    rate = rows[mode, api, conc][1]
                    print(f"{mode} {api} c={conc}: {rate:.2f} req/s", file=sys.stderr, flush=True)
                if args.overhead_reps:
                    prompt = [rng.randrange(2, vocab) for _ in range(args.prompt_tokens)]
                    lat[mode] = asyncio.run(overhead(proc, prompt, args.overhead_reps))
            finally:
                proc.stop()

    print(f"\nmodel: {what}; prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy")
    head = "| mode | api | conc | requests | req/s | out tok/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for (mode, api, conc), r in rows.items():
        print(
            f"| {mode} | {api} | {conc} | {r[0]} | {r[1]:.2f} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} | {r[6]:.1f} |"
        )
    for mode, d in lat.items():
        g, h = (statistics.median(d[a]) * 1e3 for a in ("grpc", "http"))
        g9, h9 = (pct(d[a], 0.9) * 1e3 for a in ("grpc", "http"))
        print(
            f"\n{mode}, one-token requests x{len(d['grpc'])} alternating: gRPC p50 {g:.2f} ms p90 {g9:.2f} ms, "
            f"HTTP p50 {h:.2f} ms p90 {h9:.2f} ms, HTTP - gRPC p50 {h - g:+.2f} ms"
        )
    api0 = args.apis[0]
    if "in-process" in args.modes and "cluster" in args.modes:
        print(f"\ncluster / in-process ({api0}): ", end="")
        print(
            ", ".join(
                f"c={c}: req/s x{rows['cluster', api0, c][1] / rows['in-process', api0, c][1]:.2f}, "
                f"TPOT x{rows['cluster', api0, c][5] / rows['in-process', api0, c][5]:.2f}"
                for c in args.concurrency
            )
        )
    if "grpc" in args.apis and "http" in args.apis:
        for mode in args.modes:
            print(f"{mode}, http / grpc: ", end="")
            print(
                ", ".join(
                    f"c={c}: req/s x{rows[mode, 'http', c][1] / rows[mode, 'grpc', c][1]:.2f}, "
                    f"TTFT x{rows[mode, 'http', c][3] / rows[mode, 'grpc', c][3]:.2f}, "
                    f"TPOT x{rows[mode, 'http', c][5] / rows[mode, 'grpc', c][5]:.2f}"
                    for c in args.concurrency
                )
            )


if __name__ == "__main__":
    main()
