"""Soak: many requests at mixed concurrency, with random cancellations and deadlines, against a
real cluster (coordinator + GPU expert server on the CPU + CPU expert server, each a child
process started with the real CLI, the shared-memory transport between them), then checks:

- no error other than the cancelled / deadlined requests (gRPC status of every call);
- greedy requests of a fixed prompt set return the tokens they returned one at a time;
- every KV page is free at the end (as ``Admin/ListServers`` reports them);
- no growth of open fds, threads, RSS or ``/dev/shm`` segments in any process between the end
  of the warm-up and the end of the run (after an idle second).

    python benchmarks/soak.py [--requests 10000] [--model DIR] [--seed 0] [--json OUT]

Concurrency cycles through ``--concurrency`` levels (default 1 4 16 64), ``--phase`` requests
at each. A request: a random prompt of demo-corpus words, 1-24 new tokens, greedy or sampled
with a seed; ``--cancel`` of them are cancelled after a random delay, ``--deadline`` of them get
a random gRPC deadline of 20 ms-1 s (either may finish first: both are fine). Exit status 1 when
a check fails; the table says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from expertmesh import health  # noqa: E402
from expertmesh.transport import segment  # noqa: E402
from expertmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc  # noqa: E402

_LISTEN = re.compile(r"listening on (\S+:\d+)")
GREEDY_PROMPTS = ["the cat", "once upon a time", "hello world", "a small model", "we went to", "it is"]
RSS_SLACK_MB = 30.0  # allocator noise of a Python process under load
RSS_SLACK_FRAC = 0.10


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    addr: str

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def launch(name: str, args: list[str], timeout: float = 120.0) -> Proc:
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    cmd = [sys.executable, "-m", "expertmesh.cli", *args]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    lines: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = _LISTEN.search(line)
        if m:
            threading.Thread(target=p.stdout.read, daemon=True).start()  # keep the pipe drained
            return Proc(name, p, m.group(1).replace("0.0.0.0", "127.0.0.1"))
    p.kill()
    raise RuntimeError(f"{name} did not start: {' '.join(cmd)}\n{''.join(lines)}")


def start_cluster(model: Path, kinds: list[str]) -> list[Proc]:
    common = ["--model", str(model), "--port", "0", "--threads", "1"]
    servers = []
    for kind in kinds:
        extra = ["--device", "cpu"] if kind == "gpu" else []
        servers.append(launch(f"{kind}-server", [f"{kind}-server", *extra, *common]))
    flags = [a for s in servers for a in (f"--{s.name}", s.addr)]
    if len(set(kinds)) == 2:
        flags += ["--num-gpu-experts", "8"]
    coord = launch("coordinator", ["coordinator", *common, *flags])
    end = time.monotonic() + 120
    while health.check(coord.addr, 2.0) != "SERVING":
        if time.monotonic() > end:
            raise RuntimeError("the coordinator never became ready")
        time.sleep(0.2)
    return [coord, *servers]


# ---------------------------------------------------------------------- resources


def resources(pid: int) -> dict[str, float]:
    """Open fds, threads, RSS (MB), /dev/shm entries named by ``pid`` (its own segments, which
    stay while a channel is up) and /dev/shm files it has mapped (named or already unlinked)."""
    status = Path(f"/proc/{pid}/status").read_text()
    field_ = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    shm = [n for n in segment.ours() if n.startswith(f"{segment.PREFIX}{pid}-")]
    maps = {line.split(None, 5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/dev/shm/" in line}  # fmt: skip
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(field_["Threads"]),
        "rss_mb": int(field_["VmRSS"].split()[0]) / 1024,
        "shm": len(shm),
        "shm_maps": len(maps),
    }


def grew(before: dict[str, float], after: dict[str, float]) -> list[str]:
    out = []
    for k in ("fds", "threads", "shm", "shm_maps"):
        if after[k] > before[k]:
            out.append(f"{k} {before[k]:g} -> {after[k]:g}")
    if after["rss_mb"] > before["rss_mb"] * (1 + RSS_SLACK_FRAC) + RSS_SLACK_MB:
        out.append(f"rss {before['rss_mb']:.0f} -> {after['rss_mb']:.0f} MB")
    return out


# ---------------------------------------------------------------------- load


@dataclass
class Tally:
    ok: int = 0
    cancelled: int = 0
    deadline: int = 0
    mismatches: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    tokens: int = 0

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def greedy(stub, prompt: str, n: int) -> list[int]:
    req = generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=n, ignore_eos=True)
    return [t async for c in stub.Generate(req, timeout=120) for t in c.token_ids]


async def one(stub, rng: random.Random, words: list[str], refs: dict[str, list[int]], args, t: Tally) -> None:
    if rng.random() < 0.3:  # a greedy request whose answer is known
        prompt = rng.choice(GREEDY_PROMPTS)
        req = generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=len(refs[prompt]), ignore_eos=True)
        want: list[int] | None = refs[prompt]
    else:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        req = generation_pb2.GenerateRequest(
            prompt=prompt, max_new_tokens=rng.randint(1, args.max_new_tokens)
        )
        if rng.random() < 0.5:
            req.temperature, req.top_p, req.seed = 0.8, 0.95, rng.randrange(2**32)
        want = None
    timeout = rng.uniform(0.02, 1.0) if rng.random() < args.deadline else None
    cancel_after = rng.uniform(0.0, 0.5) if rng.random() < args.cancel else None
    call = stub.Generate(req, timeout=timeout)
    got: list[int] = []

    async def read() -> None:
        async for c in call:
            got.extend(c.token_ids)

    try:
        if cancel_after is None:
            await read()
        else:
            try:
                await asyncio.wait_for(read(), cancel_after)
            except asyncio.TimeoutError:
                t.cancelled += 1  # wait_for cancelled the call
                return
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
            t.deadline += 1
        elif e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
            t.cancelled += 1
        else:
            t.error(f"{e.code().name}: {(e.details() or '')[:120]}")
        return
    t.ok += 1
    t.tokens += len(got)
    if want is not None and got != want:
        t.mismatches += 1


async def drive(addr: str, args, words: list[str], procs: list[Proc]) -> dict:
    rng = random.Random(args.seed)
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        admin = admin_pb2_grpc.AdminStub(ch)
        refs = {p: await greedy(stub, p, args.greedy_tokens) for p in GREEDY_PROMPTS}  # one at a time
        t = Tally()
        warm = max(20, args.requests // 20)
        base: dict[str, dict[str, float]] = {}
        sent, level = 0, 0
        t0 = time.monotonic()
        rows = []
        while sent < args.requests and (args.max_seconds is None or time.monotonic() - t0 < args.max_seconds):
            conc = args.concurrency[level % len(args.concurrency)]
            n = min(args.phase, args.requests - sent)
            queue = list(range(n))

            async def worker(queue: list[int] = queue) -> None:
                while queue:
                    queue.pop()
                    await one(stub, rng, words, refs, args, t)

            p0 = time.monotonic()
            await asyncio.gather(*(worker() for _ in range(min(conc, n))))
            rows.append((conc, n, time.monotonic() - p0))
            sent += n
            level += 1
            if not base and sent >= warm:
                await asyncio.sleep(1.0)
                base = {p.name: resources(p.pid) for p in procs}
            if args.progress:
                print(f"  {sent}/{args.requests} sent, {time.monotonic() - t0:.0f} s", flush=True)
        elapsed = time.monotonic() - t0
        await asyncio.sleep(1.5)  # cancellations land between steps; pools go idle
        end = {p.name: resources(p.pid) for p in procs}
        st = (await admin.ListServers(admin_pb2.ListServersRequest(), timeout=30)).coordinator
        after = {p: await greedy(stub, p, args.greedy_tokens) for p in GREEDY_PROMPTS}
    return {
        "tally": t,
        "sent": sent,
        "elapsed_s": elapsed,
        "phases": rows,
        "base": base,
        "end": end,
        "kv_pages_used": st.kv_pages_used,
        "kv_pages_total": st.kv_pages_total,
        "greedy_after_equal": after == refs,
    }


def report(r: dict, args) -> list[str]:
    t: Tally = r["tally"]
    print(f"\nsoak: {r['sent']} requests in {r['elapsed_s']:.1f} s ({r['sent'] / r['elapsed_s']:.1f} req/s), "
          f"{t.tokens} tokens from completed requests")  # fmt: skip
    print("| outcome | count |\n|---|---|")
    for k, v in (("ok", t.ok), ("cancelled", t.cancelled), ("deadline exceeded", t.deadline),
                 ("greedy mismatches", t.mismatches), ("errors", sum(t.errors.values()))):  # fmt: skip
        print(f"| {k} | {v} |")
    for what, n in sorted(t.errors.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  error x{n}: {what}")
    print(
        "\n| process | fds | threads | RSS MB | /dev/shm entries | /dev/shm mapped |\n|---|---|---|---|---|---|"
    )
    failures = []
    for name, end in r["end"].items():
        b = r["base"].get(name, end)
        print(f"| {name} | {b['fds']:g} -> {end['fds']:g} | {b['threads']:g} -> {end['threads']:g} | "
              f"{b['rss_mb']:.0f} -> {end['rss_mb']:.0f} | {b['shm']:g} -> {end['shm']:g} | "
              f"{b['shm_maps']:g} -> {end['shm_maps']:g} |")  # fmt: skip
        failures += [f"{name}: {g}" for g in grew(b, end)]
    print(f"\nKV pages in use at the end: {r['kv_pages_used']} of {r['kv_pages_total']}")
    if t.errors:
        failures.append(f"{sum(t.errors.values())} errors")
    if t.mismatches:
        failures.append(f"{t.mismatches} greedy answers differ from one-at-a-time")
    if r["kv_pages_used"]:
        failures.append(f"{r['kv_pages_used']} KV pages still in use")
    if not r["greedy_after_equal"]:
        failures.append("greedy answers after the run differ from before")
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--phase", type=int, default=100, help="requests per concurrency level before the next")
    ap.add_argument("--cancel", type=float, default=0.1, help="share of requests cancelled")
    ap.add_argument("--deadline", type=float, default=0.05, help="share of requests with a short deadline")
    ap.add_argument(
        "--max-new-tokens", type=int, default=24, help="of the random (not greedy-checked) requests"
    )
    ap.add_argument("--greedy-tokens", type=int, default=16, help="tokens of the greedy-checked requests")
    ap.add_argument("--servers", default="gpu,cpu", help="expert servers to start: gpu,cpu | cpu | gpu")
    ap.add_argument("--max-seconds", type=float, default=None, help="start no new phase after this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    from expertmesh.demo import WEIGHTS_DIR

    corpus = (ROOT / "expertmesh" / "demo" / "corpus.txt").read_text().split()
    words = sorted(set(corpus))[:2000]
    model = Path(args.model) if args.model else WEIGHTS_DIR
    procs = start_cluster(model, args.servers.split(","))
    try:
        r = asyncio.run(drive(procs[0].addr, args, words, procs))
        dead = [p.name for p in procs if p.popen.poll() is not None]
    finally:
        for p in procs:
            p.stop()
    failures = report(r, args)
    if dead:
        failures.append(f"died: {dead}")
        print(f"FAIL: died: {dead}")
    if args.json:
        t = r["tally"]
        out = {**r, "tally": {**t.__dict__}, "failures": failures, "requests": r["sent"]}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
